"""Addresses of the machines a run talks to (a Ray cluster), checked before anything waits on them,
and the access control of the Ray instances pflkit starts itself."""

from __future__ import annotations

import importlib
import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..config import ConfigError
from .reaper import reaped


def reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse a HOST:PORT that does not answer within ``timeout`` seconds (Ray itself would wait
    for minutes before giving up)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379), auto or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at {address}: {exc.strerror or exc} (is `ray start --head` "
            "running there, and is the port open?)"
        ) from None


def prepare_ray(address: str | None) -> None:
    """Before Ray starts or joins a cluster (a Ray sweep, Flower's Simulation Engine): a HOST:PORT
    address must answer, and Ray leaves the visible GPUs alone for tasks that ask for none."""
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if address and address != "auto" and "://" not in address:
        reachable(address)


#: Ray's token authentication: every request to a Ray process must carry the token
AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@contextmanager
def local_ray_access(address: str | None) -> Iterator[dict[str, Any]]:
    """Around a Ray session. Where pflkit starts Ray itself (``address`` None), that instance
    requires a fresh random token (Ray's token authentication; its processes inherit it from this
    one's environment) and advertises 127.0.0.1: Ray binds its gRPC servers to every interface,
    and a Ray instance without authentication runs code for anyone who reaches it. Yields extra
    ``ray.init`` arguments. The instance's processes end with this process, however it ends
    (``reaper``). A cluster given by ``address`` keeps its own settings (see docs/tutorials/deploy-flower.md), as does
    a caller who set RAY_AUTH_MODE."""
    if address is not None or os.environ.get("RAY_AUTH_MODE"):
        yield {}
        return
    saved = {name: os.environ.get(name) for name in AUTH_VARIABLES}
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _forget_ray_token()  # read anew by this process's Ray too
    try:
        with reaped():  # its processes end with this one, even on kill -9
            # "local": a new instance of its own, never one a `ray start` left running on this machine
            yield {"address": "local", "_node_ip_address": "127.0.0.1"}
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _forget_ray_token()


def _forget_ray_token() -> None:
    """Ray caches the token and mode it read; a later Ray session in this process reads them anew."""
    try:
        raylet = importlib.import_module("ray._raylet")
    except ImportError:
        return
    loader, config = getattr(raylet, "AuthenticationTokenLoader", None), getattr(raylet, "Config", None)
    if loader is None or config is None:  # another Ray release: nothing cached under these names
        return
    loader.instance().reset_cache()
    config.initialize("")


@contextmanager
def ray_keeps_signal_handlers() -> Iterator[None]:
    """While the block runs, Ray leaves this process's SIGTERM handling to pflkit. Ray's Python
    handler exits at once, and the failure handler of its C++ core logs a stack and aborts the
    process (exit 134), so a scheduler's SIGTERM would skip the stop that marks the folder
    interrupted. Flower's Simulation Engine calls ``ray.init`` itself, hence these hooks (Ray's
    private ones; another Ray release without them: no change). The failure handler stays off in
    Ray's worker processes too (the environment they inherit)."""
    try:
        utils: Any = importlib.import_module("ray._private.utils")  # (private: untyped)
        constants: Any = importlib.import_module("ray._private.ray_constants")
    except ImportError:
        yield
        return
    saved = (
        getattr(utils, "set_sigterm_handler", None),
        getattr(constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None),
        os.environ.get("RAY_DISABLE_FAILURE_SIGNAL_HANDLER"),
    )
    if saved[0] is not None:
        utils.set_sigterm_handler = lambda handler: None
    constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"
    try:
        yield
    finally:
        if saved[0] is not None:
            utils.set_sigterm_handler = saved[0]
        constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = saved[1]
        if saved[2] is None:
            os.environ.pop("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
        else:
            os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = saved[2]

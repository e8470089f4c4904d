"""Addresses of the machines a run talks to (a Ray cluster), checked before anything waits on them."""

from __future__ import annotations

import os
import socket

from ..config import ConfigError


def reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse a HOST:PORT that does not answer within ``timeout`` seconds (Ray itself would wait
    for minutes before giving up)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379), auto or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc} (is `ray start --head` "
                          "running there, and is the port open?)") from None


def prepare_ray(address: str | None) -> None:
    """Before Ray starts or joins a cluster (a Ray sweep, Flower's Simulation Engine): a HOST:PORT
    address must answer, and Ray leaves the visible GPUs alone for tasks that ask for none."""
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if address and address != "auto" and "://" not in address:
        reachable(address)

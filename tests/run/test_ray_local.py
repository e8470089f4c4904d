"""A Ray instance pflkit starts itself (a local Ray sweep, Flower's Simulation Engine) takes
requests only with its session's token: Ray binds its services to every interface, so one that
anyone reaching the machine could use would run their code."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.slow]

if os.environ.get("PFLKIT_REQUIRE_RAY") != "1":
    pytest.importorskip("ray")

CONNECT = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print("connected", ray.cluster_resources().get("CPU"))
"""


def outside_address() -> str:
    """This machine's address on its network (not loopback), where Ray's services also listen."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the route picks the interface
            return s.getsockname()[0]
        except OSError:
            pytest.skip("no network interface besides loopback")


def try_connect(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CONNECT, address], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_ray_started_by_pflkit_refuses_requests_without_its_token():
    import ray

    from pflkit.federation.network import local_ray_access
    from pflkit.run.cluster import connect

    before = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    with local_ray_access(None) as init_args:
        ray_module, started = connect(None, 1, 0, init_args)
        try:
            assert started
            port = ray.get_runtime_context().gcs_address.rsplit(":", 1)[1]
            token_env = dict(os.environ)
            plain_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
            host = outside_address()
            refused = try_connect(f"{host}:{port}", plain_env)
            assert refused.returncode != 0 and "connected" not in refused.stdout
            allowed = try_connect(f"{host}:{port}", token_env)  # the control: the same port, with the token
            assert allowed.returncode == 0 and "connected" in allowed.stdout, allowed.stderr[-2000:]
        finally:
            ray_module.shutdown()
    assert {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")} == before


def test_a_local_ray_sweep_runs_with_its_token(tmp_path):
    from pflkit.run.sweep import run_sweep

    record = run_sweep(None, ["dataset=synthetic", "num_clients=3", "rounds=1", 'algorithms=["fedavg"]',
                              "lr=[0.05,0.1]"], tmp_path / "s", progress=False, echo=lambda s: None, executor="ray")
    assert all("summary" in cell for cell in record["cells"]), record["cells"]

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
    return subprocess.run(
        [sys.executable, "-c", CONNECT, address], env=env, capture_output=True, text=True, timeout=120
    )


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


def test_a_local_ray_sweep_runs_with_its_token_and_a_method_from_outside_pflkit(tmp_path, monkeypatch):
    """The cells run as Ray tasks in fresh worker processes, which import the outside method by its
    dotted path as every node does (the module on their PYTHONPATH)."""
    import shutil

    from pflkit.run.sweep import run_sweep
    from tests.support.paths import REPO

    lab = tmp_path / "lab"
    lab.mkdir()
    shutil.copy(REPO / "docs" / "examples" / "mylab_methods.py", lab / "mylab_methods.py")
    monkeypatch.syspath_prepend(str(lab))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(lab), os.environ.get("PYTHONPATH")])))
    record = run_sweep(
        None,
        [
            "dataset=synthetic",
            "num_clients=3",
            "rounds=1",
            "fedala.max_start_epochs=2",
            'algorithms=["fedavg", "mylab_methods:FedPer+ala"]',
            "lr=[0.05,0.1]",
        ],
        tmp_path / "s",
        progress=False,
        echo=lambda s: None,
        executor="ray",
    )
    assert all("summary" in cell for cell in record["cells"]), record["cells"]
    assert all("mylab_methods:FedPer+ala" in cell["summary"] for cell in record["cells"])


KILLED_DRIVER = """
import os, time
from pflkit.federation.network import local_ray_access
from pflkit.run.cluster import connect

with local_ray_access(None) as init_args:
    ray, _ = connect(None, 1, 0, init_args)

    @ray.remote
    def wait():
        time.sleep(600)

    busy = wait.remote()
    time.sleep(2)
    print("READY", os.environ["PFLKIT_REAP"], flush=True)
    time.sleep(600)
"""


def test_no_ray_process_outlives_a_killed_driver():
    """kill -9 of the process that started Ray: its GCS, raylet and workers end within seconds."""
    import signal
    import time

    from pflkit.federation.reaper import marked_processes

    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line + proc.stderr.read()[-2000:]
        marker = line.split()[1]
        started = [pid for pid in marked_processes(marker) if pid != proc.pid]
        assert len(started) >= 3, started  # the GCS, the raylet and a worker at least
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 30
    while (left := marked_processes(marker)) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes still running after their driver died: {left}"

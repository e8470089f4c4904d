"""A sweep over a real Ray cluster on this machine: a head and a second node (one CPU each, loopback
only), a cell's worker killed with SIGKILL mid-run; the sweep completes with the local sweep's numbers.

Skips where Ray is not installed (``pip install -e '.[ray]' in a pflkit clone``), unless PFLKIT_REQUIRE_RAY=1 (CI)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from pflkit.config import ConfigError
from pflkit.federation.reaper import end_marked, reaped
from pflkit.run.sweep import run_sweep
from tests.support.runs import free_port, records

pytestmark = [pytest.mark.integration, pytest.mark.ray]

if os.environ.get("PFLKIT_REQUIRE_RAY") != "1":
    pytest.importorskip("ray")

RAY = Path(sys.executable).parent / "ray"
# four digits cells of several seconds each (two at a time on the two one-CPU nodes)
GRID = ["rounds=12", "num_clients=6", 'algorithms=["fedavg", "fedala"]', "lr=[0.05,0.1]", "seeds=[[0],[1]]"]


def ray_cli(*args: str, env: dict[str, str]) -> None:
    proc = subprocess.run([str(RAY), *args], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.fixture
def cluster():
    """A Ray head and a second Ray node on 127.0.0.1, ended at the end whatever happens: its own
    processes only (`ray stop` would end every Ray instance on the machine), and by a watchdog if
    the test run itself is killed (pflkit.federation.reaper)."""
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    address = f"127.0.0.1:{free_port()}"
    with reaped() as marker:  # the nodes inherit the marker from this environment
        env = {**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_USAGE_STATS_ENABLED": "0"}
        try:
            ray_cli(
                "start",
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={address.split(':')[1]}",
                "--num-cpus=1",
                "--include-dashboard=false",
                f"--temp-dir={temp}",
                "--disable-usage-stats",
                env=env,
            )
            ray_cli(
                "start",
                f"--address={address}",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=1",
                "--disable-usage-stats",
                env=env,
            )
            yield address
        finally:
            end_marked(marker)
            shutil.rmtree(temp, ignore_errors=True)


def kill_a_running_cell(parent: Path, killed: list[tuple[str, int]], stop: threading.Event) -> None:
    """SIGKILL the worker of the first cell seen running with at least two rounds recorded."""
    while not stop.is_set():
        for run in sorted(parent.glob("*/run.json")):
            try:
                status = json.loads(run.read_text())
                rows = (run.parent / "metrics.jsonl").read_text().count("\n")
            except (OSError, ValueError):
                continue
            if status.get("status") == "running" and rows >= 2:
                # Ray reuses worker processes: the pid may run another cell by the time it is killed,
                # so the test follows the pid, not the folder
                os.kill(int(status["pid"]), signal.SIGKILL)
                killed.append((run.parent.name, int(status["pid"])))
                return
        time.sleep(0.05)


@pytest.mark.slow
def test_a_sweep_on_a_two_node_ray_cluster_survives_a_killed_worker(cluster, tmp_path):
    local = run_sweep(None, GRID, tmp_path / "local", progress=False, echo=lambda s: None)
    lines: list[str] = []
    killed: list[tuple[str, int]] = []
    stop = threading.Event()
    killer = threading.Thread(target=kill_a_running_cell, args=(tmp_path / "ray", killed, stop), daemon=True)
    killer.start()
    t0 = time.perf_counter()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        remote = run_sweep(
            None,
            GRID,
            tmp_path / "ray",
            progress=False,
            echo=lines.append,
            executor="ray",
            address=cluster,
            max_retries=2,
        )
    finally:
        stop.set()
        killer.join()
    seconds = time.perf_counter() - t0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # Ray's are gone
    assert killed, "no cell was seen running: nothing was killed"
    cell, pid = killed[0]
    # the cell the killed worker was running was retried from its checkpoint, and said so
    assert any(": done" in line and f"resumed after pid {pid} died" in line for line in lines), lines
    assert all("error" not in c for c in remote["cells"]) and len(remote["cells"]) == 4
    for a, b in zip(local["cells"], remote["cells"]):
        assert a["folder"] == b["folder"]
        assert records(tmp_path / "local" / a["folder"]) == records(tmp_path / "ray" / b["folder"])
    # the sweep table reads the same
    strip = lambda text: [row.split("|")[:5] for row in text.splitlines()]  # noqa: E731  (no timing columns)
    assert strip((tmp_path / "local" / "sweep.md").read_text()) == strip((tmp_path / "ray" / "sweep.md").read_text())
    print(f"ray sweep with a killed worker: {seconds:.1f} s; killed {cell} (pid {pid})")


def test_ray_sweep_bad_input_is_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match="cannot reach the Ray cluster at 127.0.0.1:1"):
        run_sweep(
            None,
            ["rounds=1", "num_clients=4", "lr=[0.05,0.1]"],
            tmp_path / "a",
            progress=False,
            echo=lambda s: None,
            executor="ray",
            address="127.0.0.1:1",
        )
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        run_sweep(
            None,
            ["rounds=1", "num_clients=4", "lr=[0.05,0.1]"],
            tmp_path / "b",
            progress=False,
            echo=lambda s: None,
            executor="ray",
            address="nohost",
        )
    with pytest.raises(ConfigError, match="no node of the Ray cluster has 1 CPU and 64 GPU"):
        run_sweep(
            None,
            ["rounds=1", "num_clients=4", "lr=[0.05,0.1]"],
            tmp_path / "c",
            progress=False,
            echo=lambda s: None,
            executor="ray",
            gpus_per_cell=64,
        )

"""pflkit's Flower apps on Flower's Simulation Engine (virtual SuperNodes on a local Ray backend)
give the simulator's records. Skips without Ray (pip install -e '.[ray]' in a pflkit clone) unless
PFLKIT_REQUIRE_RAY=1."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from pflkit.config import ConfigError, load_config
from pflkit.run.experiment import run_experiment
from tests.support.runs import records

pytestmark = [pytest.mark.integration, pytest.mark.flower, pytest.mark.ray]

if os.environ.get("PFLKIT_REQUIRE_RAY") != "1":
    pytest.importorskip("ray")


@pytest.mark.slow
def test_a_run_on_flowers_simulation_engine_gives_the_simulators_records(tmp_path):
    from pflkit.flower.simulation import client_resources, run_on_flower_simulation

    # the loop engine: Flower runs each client on its own context (the batched ALA step of the parallel
    # engine agrees only up to float reassociation)
    config = load_config(None, ["rounds=2", "num_clients=4", 'algorithms=["fedavg", "fedala", "ditto"]', "engine=loop"])
    assert client_resources(config) == {"num_cpus": 1.0, "num_gpus": 0.0}
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    flower = run_on_flower_simulation(config, tmp_path / "flower")
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # Ray's are gone
    simulator = run_experiment(config, tmp_path / "sim", progress=False, echo=lambda s: None)
    assert records(tmp_path / "flower") == records(tmp_path / "sim")
    assert flower.keys() == simulator.keys()
    assert json.loads((tmp_path / "flower" / "run.json").read_text())["status"] == "complete"
    # killed after its checkpoints (as kill -9 leaves it): its clients' states died with the virtual
    # SuperNodes, so it is refused, not continued with other numbers
    status = json.loads((tmp_path / "flower" / "run.json").read_text())
    (tmp_path / "flower" / "run.json").write_text(json.dumps({**status, "status": "running"}))
    (tmp_path / "flower" / "summary.json").unlink()
    before = (tmp_path / "flower" / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match='state_store = "memory": its clients\' states lived in the virtual'):
        run_on_flower_simulation(config, tmp_path / "flower")
    assert (tmp_path / "flower" / "metrics.jsonl").read_bytes() == before


@pytest.mark.slow
def test_clients_of_a_simulation_keep_their_states_on_disk_with_the_disk_store(tmp_path):
    """state_store = "disk": each virtual node's state lives in a file under the results folder
    (not in the nodes' memory), with the simulator's records."""
    from pflkit.flower.simulation import run_on_flower_simulation

    config = load_config(
        None, ["rounds=2", "num_clients=3", 'algorithms=["fedala"]', "engine=loop", "state_store=disk"]
    )
    run_on_flower_simulation(config, tmp_path / "flower")
    run_experiment(config, tmp_path / "sim", progress=False, echo=lambda s: None)
    assert records(tmp_path / "flower") == records(tmp_path / "sim")
    files = sorted(
        p.relative_to(tmp_path / "flower" / "states" / "flower").as_posix()
        for p in (tmp_path / "flower" / "states" / "flower").rglob("*.pt")
    )
    assert files == [f"client{i}/pflkit.fedala.seed0.pt" for i in range(3)]


def test_flower_simulation_refuses_what_it_cannot_run(tmp_path):
    from pflkit.flower.simulation import run_on_flower_simulation

    with pytest.raises(ConfigError, match="eval_all_clients = true runs in the simulator only"):
        run_on_flower_simulation(load_config(None, ["eval_all_clients=true"]), tmp_path / "a")
    with pytest.raises(ConfigError, match="cannot reach the Ray cluster at 127.0.0.1:1"):
        run_on_flower_simulation(load_config(None, ["rounds=1"]), tmp_path / "b", ray_address="127.0.0.1:1")


@pytest.mark.slow
def test_a_simulation_prints_pflkits_lines_and_keeps_flowers_log_in_the_folder(tmp_path):
    """Flower's DEBUG and INFO lines, its database layer's (alembic) and the deprecation warnings go
    to flower.log; the terminal shows pflkit's progress, the table and where things are."""
    import subprocess
    import sys

    from tests.support.paths import REPO

    out = tmp_path / "sim"
    command = [sys.executable, "-m", "pflkit.cli", "run", "rounds=2", "num_clients=4"]
    command += ['algorithms=["fedavg","fedala"]', "engine=loop", "--out", str(out), "--on", "flower-simulation"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, "\n".join(lines[-30:])
    noise = [line for line in lines if re.search(r"DEBUG|alembic|DeprecationWarning|DEPRECATED|flwr", line)]
    assert not noise, noise
    assert len(lines) <= 30, "\n".join(lines)  # 171 lines before Flower's log went to its file
    assert any("fedala seed 0 round 2: accuracy" in line for line in lines)
    assert f"results: {out}" in lines and f"Flower's full log: {out / 'flower.log'}" in lines
    log = (out / "flower.log").read_text()
    assert "DEBUG flwr" in log and "alembic" in log

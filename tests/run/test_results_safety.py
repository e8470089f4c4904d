"""What must never lose or silently change results: a linked lock file, resumes that would drop
records or continue another run, a complete run resumed, a Flower run continuing a simulator run,
a PFLlib file whose pickle runs code, a sweep value that breaks its table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.config import load_config
from pflkit.federation.checkpoint import load_checkpoint
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.support.runs import KILL_AFTER, records_without_timings

FAST = ["dataset=synthetic", "num_clients=4", "alpha=0.5", "rounds=2", 'algorithms=["fedavg"]']


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.output


def finished(tmp: Path, *extra: str) -> Path:
    out = tmp / "run"
    code, output = run("run", *FAST, *extra, "--out", str(out), "--quiet")
    assert code == 0, output
    return out


def interrupted(tmp: Path) -> Path:
    """A finished run made to look interrupted after its last checkpoint."""
    out = finished(tmp)
    (out / "summary.json").unlink()
    status = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**status, "status": "interrupted"}))
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_a_linked_lock_file_leaves_its_target_alone(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".lock").symlink_to(target)
    code, output = run("run", *FAST, "--out", str(tmp_path / "out"), "--quiet")
    assert code != 0 and "is a symbolic link" in output
    assert target.read_text() == "keep me"


@pytest.mark.integration
def test_resuming_without_a_checkpoint_keeps_every_record(tmp_path):
    out = interrupted(tmp_path)
    (out / "checkpoints" / "fedavg-seed0.pt").unlink()
    before = (out / "metrics.jsonl").read_bytes()
    assert before.count(b"\n") == 3
    code, output = run("run", "--resume", str(out))
    assert code != 0 and "resuming would drop them" in output
    assert (out / "metrics.jsonl").read_bytes() == before


@pytest.mark.integration
def test_a_run_killed_before_its_first_regular_checkpoint_resumes_to_the_uninterrupted_numbers(tmp_path, fast_config):
    # checkpoints every 5 rounds, killed after round 3: only the save after round 1 lets it resume
    overrides = fast_config + ['algorithms=["fedala"]', "rounds=4", "checkpoint_every=5"]
    run_experiment(load_config(None, overrides), tmp_path / "full", progress=False, echo=lambda s: None)
    out = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER, str(out), *overrides], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3  # rounds 0-2 written, no regular checkpoint
    assert load_checkpoint(out / "checkpoints" / "fedala-seed0.pt").rounds_done == 1
    resume_experiment(out, progress=False, echo=lambda s: None)
    assert records_without_timings(out) == records_without_timings(tmp_path / "full")


@pytest.mark.integration
def test_a_complete_run_resumed_is_left_as_it_is(tmp_path):
    out = finished(tmp_path)
    before = snapshot(out)
    code, output = run("run", "--resume", str(out), "--quiet")
    assert code == 0 and "holds a complete run: nothing to resume" in output
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k != "run.json"} == {k: v for k, v in before.items() if k != "run.json"}
    assert json.loads(after["run.json"])["status"] == "complete"


@pytest.mark.integration
def test_another_runs_checkpoint_is_refused_and_changes_nothing(tmp_path):
    other = finished(tmp_path / "other", "seeds=[3]")
    out = interrupted(tmp_path)
    (out / "checkpoints" / "fedavg-seed0.pt").write_bytes((other / "checkpoints" / "fedavg-seed3.pt").read_bytes())
    before = (out / "metrics.jsonl").read_bytes()
    code, output = run("run", "--resume", str(out))
    assert code != 0 and "is the state of fedavg seed 3, not of fedavg seed 0" in output
    assert (out / "metrics.jsonl").read_bytes() == before


@pytest.mark.integration
def test_a_checkpoint_of_the_same_method_and_seed_under_another_config_is_refused(tmp_path):
    other = finished(tmp_path / "other", "lr=0.02")
    out = interrupted(tmp_path)
    (out / "checkpoints" / "fedavg-seed0.pt").write_bytes((other / "checkpoints" / "fedavg-seed0.pt").read_bytes())
    code, output = run("run", "--resume", str(out))
    assert code != 0 and "fedavg seed 0 under another config" in output


@pytest.mark.integration
@pytest.mark.flower
def test_flower_does_not_continue_a_simulator_run(tmp_path):
    pytest.importorskip("flwr")
    from pflkit.config import load_config
    from pflkit.flower.client_app import app as client_app
    from pflkit.flower.local import LocalGrid
    from pflkit.flower.server import run_on_flower

    out = interrupted(tmp_path)
    before = (out / "metrics.jsonl").read_bytes()
    grid = LocalGrid(client_app, [{"partition-id": i, "num-partitions": 4} for i in range(4)])
    with pytest.raises(RuntimeError, match="was run in the simulator .pflkit run.; it continues only there"):
        run_on_flower(load_config(out / "config.toml"), grid, out, wait_seconds=5)
    assert (out / "metrics.jsonl").read_bytes() == before


def test_a_pfllib_pickle_that_would_run_code_is_refused_before_it_runs(tmp_path):
    from pflkit.data import DataError
    from pflkit.data.pfllib import _read

    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    np.savez_compressed(tmp_path / "0.npz", data=np.array([Exploit()], dtype=object))
    with pytest.raises(DataError, match="its pickle calls posix.mkdir"):
        _read(tmp_path / "0.npz")
    assert not marker.exists()
    # PFLlib's own format still reads: a dict of arrays in an object array
    x = np.random.default_rng(0).normal(size=(3, 1, 4, 4)).astype(np.float32)
    np.savez_compressed(tmp_path / "1.npz", data={"x": x, "y": np.array([1, 2, 3])})
    read_x, read_y = _read(tmp_path / "1.npz")
    assert np.array_equal(read_x, x) and read_y.tolist() == [1, 2, 3]


@pytest.mark.integration
def test_a_pipe_in_a_sweep_value_stays_inside_its_cell(tmp_path):
    from pflkit.run.sweep import run_sweep

    run_sweep(
        None,
        [*FAST[:-1], "rounds=1", 'algorithms=["fedavg"]', 'name=["a|b", "c"]'],
        tmp_path / "s",
        progress=False,
        echo=lambda s: None,
    )
    rows = (tmp_path / "s" / "sweep.md").read_text().splitlines()
    widths = {row.replace("\\|", "").count("|") for row in rows}
    assert len(widths) == 1, rows  # every row has the header's columns
    assert any("a\\|b" in row for row in rows)
    json.loads((tmp_path / "s" / "sweep.json").read_text())

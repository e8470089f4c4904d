"""Results folders nothing can corrupt: one writer at a time, interrupted runs that say how to
continue, sweeps that survive a failing cell, and folder names that never collide."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.config import load_config
from pflkit.federation import ResultsFolder, RunInterrupted, signals_deferred, stop_on_signals
from pflkit.run.experiment import new_results_folder, run_experiment
from pflkit.run.sweep import MAX_CELL_NAME, cell_name

FAST = ["dataset=synthetic", "num_clients=4", "alpha=0.5", "lr=0.05", 'algorithms=["fedavg"]']


def rows(folder: Path) -> list[tuple[str, int, int]]:
    return [
        (r["algorithm"], r["seed"], r["round"])
        for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    ]


def numbers(folder: Path) -> list[dict]:
    """metrics.jsonl without its wall-clock fields."""
    return [
        {k: v for k, v in r.items() if "seconds" not in k}
        for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    ]


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Wait until ``condition()`` holds; fail naming ``what`` (and the process's output) if it never does."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{err.decode()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_second_process_is_refused_and_a_stopped_run_says_how_to_continue(tmp_path, stop):
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "pflkit.cli", "run", *FAST, "rounds=100000", "--out", str(out), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file() and len(rows(out)) >= 3, "three rounds recorded", first)
        holder = (out / ".lock").read_text()
        assert f"pflkit pid {first.pid} on host" in holder
        for second in (["run", "--resume", str(out)], ["run", *FAST, "rounds=3", "--out", str(out)]):
            refused = subprocess.run(
                [sys.executable, "-m", "pflkit.cli", *second, "--quiet"], capture_output=True, timeout=120
            )
            assert refused.returncode == 2, refused.stderr.decode()
            assert f"is in use by pflkit pid {first.pid}" in refused.stderr.decode()
        first.send_signal(stop)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    reason = "stopped by SIGTERM" if stop == signal.SIGTERM else "interrupted (Ctrl-C)"
    assert first.returncode == 130, err.decode()[-2000:]
    assert (
        f"{reason}: the rounds up to the last checkpoint are kept; continue with: pflkit run --resume {out}"
        in err.decode()
    )
    assert "Traceback" not in err.decode()
    status = ResultsFolder(out).status()
    assert status["status"] == "interrupted" and status["resume"] == f"pflkit run --resume {out}"
    recorded = rows(out)
    assert len(recorded) == len(set(recorded))  # the refused processes wrote nothing


@pytest.mark.integration
def test_an_interrupted_sweep_says_the_whole_command_to_continue_with(tmp_path):
    out = tmp_path / "sweep"
    command = [
        sys.executable,
        "-m",
        "pflkit.cli",
        "sweep",
        *FAST,
        "rounds=100000",
        "lr=[0.05,0.1]",
        "--out",
        str(out),
        "--metric",
        "final_accuracy",
        "--quiet",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        cell = out / "lr=0.05"
        wait_for(
            lambda: (cell / "metrics.jsonl").is_file() and len(rows(cell)) >= 2, "two rounds of the first cell", proc
        )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.decode()
    assert proc.returncode == 130, text[-2000:]
    assert "Traceback" not in text
    assert f"--out {out} --metric final_accuracy): finished cells are kept and the interrupted one resumes" in text


@pytest.mark.integration
def test_a_complete_run_resumed_again_changes_nothing(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", *FAST, "rounds=4", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    full = rows(out)
    assert len(full) == len(set(full)) == 5
    # a complete folder resumed again changes nothing
    result = CliRunner().invoke(main, ["run", "--resume", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert rows(out) == full


def test_default_folders_started_in_the_same_second_differ(tmp_path):
    folders = [new_results_folder("demo", tmp_path) for _ in range(3)]
    assert len(set(folders)) == 3 and all(f.is_dir() and f.parent == tmp_path for f in folders)
    assert all(f.name.startswith("demo-20") for f in folders)


@pytest.mark.integration
def test_a_failing_cell_is_recorded_and_the_sweep_goes_on(tmp_path):
    out = tmp_path / "sw"
    args = ["sweep", *FAST, "rounds=1", "lr=[1e12,0.05]", "--out", str(out), "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "sweep cell lr=1000000000000.0 failed: NonFiniteLossError" in result.output
    record = json.loads((out / "sweep.json").read_text())
    failed, done = record["cells"]
    assert "NonFiniteLossError" in failed["error"] and "summary" not in failed
    assert "fedavg" in done["summary"]
    table = (out / "sweep.md").read_text()
    assert "| 1000000000000.0 | - | failed: NonFiniteLossError" in table and "| 0.05 | fedavg |" in table
    assert ResultsFolder(out / "lr=1000000000000.0").status()["status"] == "failed"
    finished = (out / "lr=0.05" / "summary.json").stat().st_mtime_ns
    again = CliRunner().invoke(main, args)  # the failed cell is tried again, the finished one is kept
    assert again.exit_code == 1 and "lr=1000000000000.0 failed" in again.output
    assert (out / "lr=0.05" / "summary.json").stat().st_mtime_ns == finished


@pytest.mark.integration
def test_a_sweep_cell_reruns_from_the_reproduce_command_of_the_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    result = CliRunner().invoke(main, ["sweep", *FAST, "rounds=1", "lr=[0.05]", "--out", "sw", "--quiet"])
    assert result.exit_code == 0, result.output
    cell = Path("sw") / "lr=0.05"
    # from the parent, and from the sweep folder, where the path itself reads like an override
    for path, out in ((cell / "config.toml", "a"), (Path("lr=0.05") / "config.toml", "b")):
        again = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / out), "--quiet"])
        assert again.exit_code == 0, again.output
        assert (tmp_path / out / "metrics.jsonl").read_text().count('"accuracy"') == (
            tmp_path / cell / "metrics.jsonl"
        ).read_text().count('"accuracy"')
        assert [
            r["accuracy"] for r in map(json.loads, (tmp_path / out / "metrics.jsonl").read_text().splitlines())
        ] == [r["accuracy"] for r in map(json.loads, (tmp_path / cell / "metrics.jsonl").read_text().splitlines())]
        monkeypatch.chdir(tmp_path / "sw")


def test_long_cell_names_are_cut_with_a_hash_and_stay_distinct():
    long = [("algorithms", ["fedavg", "fedprox", "ditto", "fedrep", "fedala", "fedamp", "fedbn", "fedper"] * 2)]
    other = [("algorithms", ["fedavg", "fedprox", "ditto", "fedrep", "fedala", "fedamp", "fedbn", "fedper"] * 3)]
    a, b = cell_name(long), cell_name(other)
    assert len(a) == len(b) == MAX_CELL_NAME and a != b and a[: MAX_CELL_NAME - 9] == b[: MAX_CELL_NAME - 9]
    assert cell_name([("lr", 0.1)]) == "lr=0.1"


class StopInRound2:
    """Callback: a stop signal arrives while round 2's record is handled, either inside a block
    that defers it (a checkpoint write) or inside a library call that turns the KeyboardInterrupt
    into a RuntimeError (what torch.save's C++ writer does)."""

    def __init__(self, how: str) -> None:
        self.how, self.deferred_until_after_block = how, None

    def on_record(self, state, record) -> None:
        if record["round"] != 2:
            return
        if self.how == "deferred":
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                self.deferred_until_after_block = True  # still here: the signal waited
        else:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except KeyboardInterrupt:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from None


@pytest.mark.integration
@pytest.mark.parametrize("how", ["deferred", "converted"])
def test_a_stop_signal_during_a_write_still_ends_as_an_interruption(tmp_path, how):
    callback = StopInRound2(how)
    config = load_config(None, [*FAST, "rounds=5"])
    with pytest.raises(RunInterrupted) as stopped, stop_on_signals():
        run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None, callbacks=[callback])
    expected = "stopped by SIGTERM" if how == "deferred" else "interrupted (Ctrl-C)"
    assert stopped.value.reason == expected
    assert callback.deferred_until_after_block is (True if how == "deferred" else None)
    status = ResultsFolder(tmp_path / "run").status()
    assert status["status"] == "interrupted" and status["error"] == expected
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers were given back
    result = CliRunner().invoke(main, ["run", "--resume", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert [r[2] for r in rows(tmp_path / "run")] == [0, 1, 2, 3, 4, 5]
    # and the resumed rows are an uninterrupted run's, number for number
    run_experiment(config, tmp_path / "full", progress=False, echo=lambda s: None)
    assert numbers(tmp_path / "run") == numbers(tmp_path / "full")


def test_an_unfinished_folder_with_an_older_flat_config_is_continued_on_flower(tmp_path):
    """``start_or_resume`` (a restarted Flower ServerApp) compares the saved config with the run's
    in their resolved form, so a folder whose config.toml spells its keys flat is the same run."""
    from pflkit.config import build_config, to_dict
    from tests.support.configs import flat_form

    config = to_dict(load_config(None, FAST))
    folder = ResultsFolder(tmp_path / "run")
    folder.create(flat_form(config))  # as an older pflkit wrote it
    resolve = lambda saved: to_dict(build_config(saved))  # noqa: E731
    assert folder.start_or_resume(config, resolve) is True
    with pytest.raises(FileExistsError, match=r"differs in train\.lr\)"):
        folder.start_or_resume({**config, "train": {**config["train"], "lr": 0.5}}, resolve)


def test_a_results_folder_reads_back_its_files(tmp_path):
    """ResultsFolder is the one reader of a folder's files: metrics.jsonl as records and as
    histories by (algorithm, seed), summary.json and config.toml, each naming a damaged file."""
    folder = ResultsFolder(tmp_path)
    assert folder.records() == [] and folder.histories() == {}  # no metrics.jsonl yet
    rows = [
        {"algorithm": "fedavg", "seed": 0, "round": 0},
        {"algorithm": "fedala", "seed": 1, "round": 0},
        {"algorithm": "fedavg", "seed": 0, "round": 1},
    ]
    folder.rewrite_metrics(rows)
    assert folder.records() == rows
    assert folder.histories() == {("fedavg", 0): [rows[0], rows[2]], ("fedala", 1): [rows[1]]}
    folder.write_summary({"fedavg": {"best_accuracy": 0.5}})
    assert folder.summary() == {"fedavg": {"best_accuracy": 0.5}}
    folder.summary_path.write_text("[1]\n")
    with pytest.raises(ValueError, match="summary.json holds a JSON list"):
        folder.summary()
    folder.config_path.write_text('name = "x"\n')
    assert folder.config_table() == {"name": "x"}
    folder.config_path.write_text("name = \n")
    with pytest.raises(ValueError, match="config.toml is not a readable config"):
        folder.config_table()

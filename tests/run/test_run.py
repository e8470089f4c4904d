"""End-to-end runs, resume equivalence (incl. kill -9), determinism and bad input."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.config import ConfigError, load_config
from pflkit.data import DataError, PartitionError, write_idx
from pflkit.federation import ResultsFolder
from pflkit.functional import NonFiniteLossError
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.support.runs import KILL_AFTER, InterruptAfter, records_without_timings

ALGOS = 'algorithms=["fedavg","fedprox","ditto","fedrep","fedala","fedprox+ala","ditto+ala"]'


@pytest.mark.integration
def test_cli_two_rounds_writes_a_complete_results_folder(tmp_path, fast_config):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", *fast_config, ALGOS, "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "results:" in result.output and "fedala" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"fedavg", "fedprox", "ditto", "fedrep", "fedala", "fedprox+ala", "ditto+ala"}
    for entry in summary.values():
        for key in ("best_accuracy", "final_accuracy", "best_mean_client_accuracy", "mean_seconds_per_round"):
            assert np.isfinite(entry[key])
        assert 0 <= entry["final_accuracy"] <= entry["best_accuracy"] <= 1
    recs = records_without_timings(out)
    assert len(recs) == 7 * 3  # rounds 0, 1, 2 for each algorithm
    assert [r["round"] for r in recs[:3]] == [0, 1, 2]
    assert all(r["evaluated_clients"] == 4 for r in recs)
    fedala = [r for r in recs if r["algorithm"] == "fedala"]
    assert fedala[1]["ala_epochs"] == 0 and fedala[2]["ala_epochs"] > 0  # inactive in round 1
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    for png in ("accuracy.png", "partition-seed0.png"):
        assert (out / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    assert load_config(out / "config.toml").train.rounds == 2


@pytest.mark.integration
def test_same_seed_gives_identical_numbers_and_seeds_summarize(tmp_path, fast_config):
    cfg = load_config(None, fast_config + ['algorithms=["fedala"]', "seeds=[0, 1]"])
    s1 = run_experiment(cfg, tmp_path / "a", progress=False, echo=lambda s: None)
    s2 = run_experiment(cfg, tmp_path / "b", progress=False, echo=lambda s: None)
    assert records_without_timings(tmp_path / "a") == records_without_timings(tmp_path / "b")
    assert s1["fedala"]["best_accuracy"] == s2["fedala"]["best_accuracy"]
    per_seed = [s1["fedala"]["seeds"][k]["best_accuracy"] for k in ("0", "1")]
    assert s1["fedala"]["best_accuracy"] == pytest.approx(np.mean(per_seed))
    assert s1["fedala"]["best_accuracy_std"] == pytest.approx(np.std(per_seed))


@pytest.mark.integration
def test_resume_after_interruption_equals_uninterrupted_run(tmp_path, fast_config):
    overrides = fast_config + ['algorithms=["fedavg","fedala"]', "rounds=4"]
    cfg = load_config(None, overrides)
    run_experiment(cfg, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):  # inside fedala's second round, after fedavg finished
        run_experiment(
            cfg, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedala", 2)]
        )
    status = ResultsFolder(tmp_path / "cut").status()
    assert status["status"] == "interrupted" and not (tmp_path / "cut" / "summary.json").exists()
    assert status["error"] == "simulated interruption"
    assert status["resume"] == f"pflkit run --resume {tmp_path / 'cut'}"
    resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    assert records_without_timings(tmp_path / "cut") == records_without_timings(tmp_path / "full")


@pytest.mark.integration
def test_a_folder_with_an_older_flat_config_resumes(tmp_path, fast_config):
    """A results folder written before the config had sections holds a flat config.toml (its
    digest in run.json is that text's): --resume loads it and continues to the same numbers."""
    import tomli_w

    from pflkit.config import to_dict
    from pflkit.federation.results import config_digest
    from tests.support.configs import flat_form

    cfg = load_config(None, fast_config + ['algorithms=["fedavg"]', "rounds=3"])
    run_experiment(cfg, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            cfg, tmp_path / "old", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedavg", 1)]
        )
    folder = ResultsFolder(tmp_path / "old")
    text = tomli_w.dumps(flat_form(to_dict(cfg)))
    assert "[train]" not in text and "lr = " in text
    folder.config_path.write_text(text)
    status = json.loads((folder.root / "run.json").read_text())
    (folder.root / "run.json").write_text(json.dumps({**status, "config_sha256": config_digest(text)}))
    checkpoint = folder.checkpoint_path("fedavg", 0)  # as that release wrote it: no config digest inside
    raw = torch.load(checkpoint, weights_only=True)
    del raw["config_sha256"]
    torch.save(raw, checkpoint)
    result = CliRunner().invoke(main, ["run", "--resume", str(folder.root), "--quiet"])
    assert result.exit_code == 0, result.output
    assert records_without_timings(folder.root) == records_without_timings(tmp_path / "full")
    assert folder.config_path.read_text() == text  # the folder keeps the file it was started with


@pytest.mark.integration
def test_kill_9_then_resume_gives_the_same_metrics(tmp_path, fast_config):
    # checkpoints every 2 rounds: the kill after round 3 leaves a metrics row past the last checkpoint
    overrides = fast_config + ['algorithms=["fedavg","fedala"]', "rounds=6", "checkpoint_every=2"]
    run_experiment(load_config(None, overrides), tmp_path / "full", progress=False, echo=lambda s: None)
    out = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER, str(out), *overrides], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert not (out / "summary.json").exists()
    # one row past the checkpoint
    assert [r["round"] for r in records_without_timings(out) if r["algorithm"] == "fedala"] == [0, 1, 2]
    result = CliRunner().invoke(main, ["run", "--resume", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert records_without_timings(out) == records_without_timings(tmp_path / "full")


@pytest.mark.parametrize(
    "override,needle",
    [
        ("fedala.etaa=1.0", "fedala.etaa: unknown key"),
        ("colour=1", "colour: unknown key"),
        ('rounds="three"', "rounds"),
        ("alpha=-1.0", "alpha"),
        ("join_ratio=1.5", "join_ratio"),
        ('algorithms=["fedsomething"]', "unknown algorithm 'fedsomething'"),
        ('partition="random"', "partition"),
        ("device=tpu", "device"),
        ("dataset=mnist", "needs data_dir"),
    ],
)
def test_bad_config_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(None, [override])


def test_bad_config_file_and_cli_exit_code(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = 3\n[fedala]\nnope = 1\n")
    with pytest.raises(ConfigError, match="fedala.nope: unknown key"):
        load_config(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("rounds = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)
    result = CliRunner().invoke(main, ["run", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "fedala.nope" in result.output
    assert not (tmp_path / "o").exists()


def test_missing_and_corrupt_data_files_are_named_and_leave_no_folder(tmp_path):
    empty = tmp_path / "mnist"
    empty.mkdir()
    cfg = load_config(None, ["dataset=mnist", f"data_dir='{empty}'", "num_clients=2"])
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):
        run_experiment(cfg, tmp_path / "out1", progress=False)
    assert not (tmp_path / "out1").exists()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 10)):
        write_idx(empty / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28), dtype=np.uint8))
        write_idx(empty / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, n, dtype=np.uint8))
    corrupt = empty / "t10k-images-idx3-ubyte.gz"
    corrupt.write_bytes(gzip.compress(gzip.decompress(corrupt.read_bytes())[:-100]))
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte"):
        run_experiment(cfg, tmp_path / "out2", progress=False)
    assert not (tmp_path / "out2").exists()


def test_impossible_partition_is_refused_before_any_output(tmp_path):
    cfg = load_config(None, ["dataset=synthetic", "num_clients=500", "min_samples_per_client=40"])
    with pytest.raises(PartitionError, match="500"):
        run_experiment(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_nan_loss_stops_with_a_clear_error_and_a_failed_folder(tmp_path, fast_config):
    cfg = load_config(None, fast_config + ['algorithms=["fedavg"]', "lr=1e12"])
    with pytest.raises(NonFiniteLossError, match=r"algorithm fedavg, client \d+, round \d+"):
        run_experiment(cfg, tmp_path / "out", progress=False)
    status = ResultsFolder(tmp_path / "out").status()
    assert status["status"] == "failed" and "NonFiniteLossError" in status["error"]
    assert not (tmp_path / "out" / "summary.json").exists()


def test_refuses_to_overwrite_a_results_folder(tmp_path, fast_config):
    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("x")
    result = CliRunner().invoke(main, ["run", *fast_config, "--out", str(out)])
    assert result.exit_code == 2 and "already exists" in result.output
    result = CliRunner().invoke(main, ["run", "--resume", str(out)])
    assert result.exit_code == 2 and "not a pflkit results folder" in result.output


@pytest.mark.integration
def test_seconds_per_round_counts_the_final_pass_where_a_one_round_run_meets_alas_start_phase(tmp_path, fast_config):
    from pflkit.reporting.summary import run_metrics

    out = tmp_path / "run"
    result = CliRunner().invoke(
        main, ["run", *fast_config, "rounds=1", 'algorithms=["fedavg","fedala"]', "--out", str(out), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    fedala = [r for r in history if r["algorithm"] == "fedala"]
    # round 1: ALA is idle (nothing received yet); the final pass after it runs the start phase
    assert [r["round"] for r in fedala] == [0, 1] and fedala[1]["ala_epochs"] == 0
    assert fedala[1]["final_pass_init_seconds"] > 0
    summary = json.loads((out / "summary.json").read_text())
    for algorithm in ("fedavg", "fedala"):
        last = [r for r in history if r["algorithm"] == algorithm][-1]
        assert last["final_pass_seconds"] > 0
        # every pass a user waits for over the one round, and the training round alone
        assert summary[algorithm]["seconds_per_round"] == pytest.approx(last["seconds"] + last["final_pass_seconds"])
        assert summary[algorithm]["mean_seconds_per_round"] == pytest.approx(last["seconds"])
    assert summary["fedala"]["init_seconds_per_round"] == pytest.approx(
        fedala[1].get("init_seconds", 0.0) + fedala[1]["final_pass_init_seconds"]
    )
    # over two rounds the final pass is spread over both
    rows = [
        {"round": 0, "accuracy": 0.1, "std_client_accuracy": 0.0},
        {"round": 1, "accuracy": 0.2, "std_client_accuracy": 0.0, "seconds": 3.0, "init_seconds": 1.0},
        {
            "round": 2,
            "accuracy": 0.3,
            "std_client_accuracy": 0.0,
            "seconds": 5.0,
            "init_seconds": 0.5,
            "final_pass_seconds": 2.0,
            "final_pass_init_seconds": 1.5,
        },
    ]
    metrics = run_metrics(rows)
    assert (metrics["seconds_per_round"], metrics["init_seconds_per_round"], metrics["mean_seconds_per_round"]) == (
        5.0,
        1.5,
        4.0,
    )

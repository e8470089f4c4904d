"""benchmarks/trace_steps.py: one client's steps in the round after a run's checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pflkit.config import load_config
from pflkit.engines import client as client_engine
from pflkit.federation.checkpoint import load_checkpoint
from pflkit.federation.preparation import build_partitions, partition_seed
from pflkit.run.experiment import run_experiment
from tests.support.paths import load_script
from tests.support.runs import InterruptAfter

pytestmark = pytest.mark.integration


def _script():  # type: ignore[no-untyped-def]
    return load_script("benchmarks/trace_steps.py")


def _interrupted(tmp_path, fast_config, algorithm: str, *extra: str):  # type: ignore[no-untyped-def]
    """A run of ``algorithm`` stopped after round 1 with its checkpoint; its config."""
    config = load_config(
        None, fast_config + [f'algorithms=["{algorithm}"]', "rounds=3", "checkpoint_every=1", "seeds=[0]", *extra]
    )
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            config, tmp_path / "run", progress=False, echo=lambda s: None, callbacks=[InterruptAfter(algorithm, 1)]
        )
    return config


def test_the_trace_starts_from_the_checkpointed_global_model_and_covers_the_clients_epochs(
    tmp_path, fast_config
) -> None:
    config = _interrupted(tmp_path, fast_config, "fedavg", "local_epochs=2")
    rows: list[dict] = []
    assert _script().trace_steps(tmp_path / "run", 2, rows.append) is None

    config, partitions = build_partitions(config, torch.device("cpu"))
    client = partitions[partition_seed(config, 0)].clients[2]
    assert len(rows) == 2 * (client.num_train // config.train.batch_size)  # full batches (drop_last), two epochs
    assert [row["step"] for row in rows] == list(range(len(rows)))
    assert {(row["algorithm"], row["seed"], row["round"], row["stage"]) for row in rows} == {
        ("fedavg", 0, 2, "local training")
    }
    assert all(math.isfinite(row["loss"]) and row["loss"] > 0 for row in rows)
    received = load_checkpoint(tmp_path / "run" / "checkpoints" / "fedavg-seed0.pt").server["global"]
    assert rows[0]["norms"] == pytest.approx({k: float(v.norm()) for k, v in received.items()}, rel=1e-6)
    assert rows[1]["norms"] != rows[0]["norms"]


def test_a_later_round_is_traced_after_the_rounds_before_it_run_untraced(tmp_path, fast_config) -> None:
    _interrupted(tmp_path, fast_config, "fedavg")  # checkpoint after round 1 of 3
    rows: list[dict] = []
    assert _script().trace_steps(tmp_path / "run", 2, rows.append, at_round=3) is None
    assert rows and {row["round"] for row in rows} == {3}
    next_round: list[dict] = []
    assert _script().trace_steps(tmp_path / "run", 2, next_round.append) is None
    assert {row["round"] for row in next_round} == {2}
    assert rows[0]["norms"] != next_round[0]["norms"]  # round 3 starts from round 2's aggregate
    with pytest.raises(ValueError, match="client 2 does not train in round 1 \\(its next training: round 2\\)"):
        _script().trace_steps(tmp_path / "run", 2, print, at_round=1)


def test_a_loss_that_turns_nan_is_traced_to_the_runs_error_in_strict_json(tmp_path, fast_config, monkeypatch) -> None:
    _interrupted(tmp_path, fast_config, "fedavg")
    real = client_engine.loss_value
    rows: list[dict] = []

    def blows_up(*args):  # type: ignore[no-untyped-def]  # the traced client's sixth step on
        value, updates = real(*args)
        return (value * math.inf if len(rows) >= 5 else value), updates

    monkeypatch.setattr(client_engine, "loss_value", blows_up)
    fit = client_engine.SingleClientContext.fit
    error = _script().trace_steps(tmp_path / "run", 0, rows.append)
    assert error is not None and error.startswith("NonFiniteLossError") and "client 0, round 2" in error
    assert [row["loss"] for row in rows[:5]] == [row["loss"] for row in rows[:5] if math.isfinite(row["loss"])]
    assert rows[5]["loss"] == "inf"
    assert all(json.dumps(row, allow_nan=False) for row in rows)
    assert client_engine.SingleClientContext.fit is fit and client_engine.loss_value is blows_up  # restored


def test_a_client_trained_by_step_functions_only_is_named_not_traced_empty(tmp_path, fast_config) -> None:
    _interrupted(tmp_path, fast_config, "pfedme")
    with pytest.raises(ValueError, match="round 2 trained only with step functions"):
        _script().trace_steps(tmp_path / "run", 1, print)


def test_a_client_the_run_does_not_have_is_refused_before_resuming(tmp_path, fast_config) -> None:
    _interrupted(tmp_path, fast_config, "fedavg")
    with pytest.raises(ValueError, match="clients 0-3: there is no client 9"):
        _script().trace_steps(tmp_path / "run", 9, print)


def test_a_folder_without_a_checkpoint_is_named(tmp_path) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        _script().trace_steps(tmp_path / "run", 0, print)

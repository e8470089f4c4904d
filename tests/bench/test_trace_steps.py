"""benchmarks/trace_steps.py: one client's steps in the round after a run's checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from pflkit.config import load_config
from pflkit.federation.checkpoint import load_checkpoint
from pflkit.federation.preparation import build_partitions, partition_seed
from pflkit.run.experiment import run_experiment
from tests.support.paths import load_script
from tests.support.runs import InterruptAfter

pytestmark = pytest.mark.integration


def _script():  # type: ignore[no-untyped-def]
    return load_script("benchmarks/trace_steps.py")


def test_the_trace_starts_from_the_checkpointed_global_model_and_covers_the_clients_epochs(
    tmp_path, fast_config
) -> None:
    config = load_config(
        None, fast_config + ['algorithms=["fedavg"]', "rounds=3", "checkpoint_every=1", "seeds=[0]", "local_epochs=2"]
    )
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            config, tmp_path / "run", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedavg", 1)]
        )
    rows: list[dict] = []
    assert _script().trace_steps(tmp_path / "run", 2, rows.append) is None

    config, partitions = build_partitions(config, torch.device("cpu"))
    client = partitions[partition_seed(config, 0)].clients[2]
    assert len(rows) == 2 * (client.num_train // config.train.batch_size)  # full batches (drop_last), two epochs
    assert [row["step"] for row in rows] == list(range(len(rows)))
    assert all(math.isfinite(row["loss"]) and row["loss"] > 0 for row in rows)
    received = load_checkpoint(tmp_path / "run" / "checkpoints" / "fedavg-seed0.pt").server["global"]
    assert rows[0]["norms"] == pytest.approx({k: float(v.norm()) for k, v in received.items()}, rel=1e-6)
    assert rows[1]["norms"] != rows[0]["norms"]


def test_a_folder_without_a_checkpoint_is_named(tmp_path) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        _script().trace_steps(tmp_path / "run", 0, print)

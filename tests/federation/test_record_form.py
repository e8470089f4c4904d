"""The form records are kept in: times to 0.1 ms, float32 values as their shortest decimal,
everything else as computed."""

from __future__ import annotations

import json

import numpy as np

from pflkit.config import load_config
from pflkit.federation.record_form import recorded
from pflkit.run.experiment import run_experiment


def test_times_keep_four_decimals_and_float32_values_their_shortest_decimal() -> None:
    loss = float(np.float32(0.2303081425))  # a float32 loss: 0.23030814528465271 as a float64
    record = {
        "round": 3,
        "seconds": 33.23584265999989,
        "final_pass_init_seconds": 0.00004999,
        "train_loss": loss,
        "accuracy": 0.6541580991546722,  # a float64 ratio: every digit kept
        "down_bytes": 46562080.0,
        "client_accuracy": {"0": float(np.float32(1 / 3)), "1": 0.2},
        "ala_start_losses": [float(np.float32(0.1)), 2.0],
        "update_variance": float("nan"),
        "stopped": "plateau",
    }
    assert recorded(record) == {
        "round": 3,
        "seconds": 33.2358,
        "final_pass_init_seconds": 0.0,
        "train_loss": 0.23030815,
        "accuracy": 0.6541580991546722,
        "down_bytes": 46562080.0,
        "client_accuracy": {"0": 0.33333334, "1": 0.2},
        "ala_start_losses": [0.1, 2.0],
        "update_variance": record["update_variance"],
        "stopped": "plateau",
    }
    assert record["seconds"] == 33.23584265999989  # a new dict: the caller's record is not changed


def test_a_float32_value_reads_back_as_the_same_float32() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(2000), rng.exponential(1e-6, 500), rng.exponential(1e6, 500)])
    for single in values.astype(np.float32):
        kept = recorded({"loss": float(single)})["loss"]
        assert np.float32(kept) == single
        assert len(repr(kept)) <= len(repr(float(single)))


def test_a_runs_written_records_hold_times_to_a_tenth_of_a_millisecond(tmp_path, fast_config) -> None:
    config = load_config(None, [*fast_config, "algorithms=['fedala']"])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    checked = 0
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        for key, value in json.loads(line).items():
            if key.endswith("seconds"):
                assert round(value, 4) == value, (key, value)
                checked += 1
            elif key == "update_variance":  # a float32 statistic
                assert repr(value) == str(np.float32(value)), value
                checked += 1
    assert checked > 6

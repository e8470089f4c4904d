"""Communication accounting: values and bytes counted from the real payloads and uploads."""

from __future__ import annotations

import json

import pytest
import torch

from pflkit.config import load_config
from pflkit.functional import message_size
from pflkit.models import build_model
from pflkit.run.experiment import run_experiment


def test_message_size_counts_tensors_and_numbers() -> None:
    payload = {
        "global": {"w": torch.zeros(3, 4), "b": torch.zeros(4)},
        "ids": torch.tensor([1, 2], dtype=torch.long),
        "models": [{"w": torch.zeros(2, dtype=torch.float64)}],
        "score": 0.5,
    }
    assert message_size(payload) == (12 + 4 + 2 + 2 + 1, 4 * 16 + 8 * 2 + 8 * 2 + 4)


@pytest.mark.integration
def test_round_byte_counts_equal_the_payload_sizes_by_hand(tmp_path) -> None:
    config = load_config(None, ["num_clients=5", "rounds=1", 'algorithms=["fedavg", "fedrep", "fedfomo"]'])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    rows = {
        r["algorithm"]: r
        for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if r.get("train_round") == 1
    }
    model = build_model("digits_cnn", (1, 8, 8), 10)
    sigma = sum(p.numel() for p in model.parameters())  # 13,706 values
    head = model.fc.weight.numel() + model.fc.bias.numel()
    # FedAvg (FedALA Table 3: 2 Sigma per client and round): the model down, the model up
    assert (rows["fedavg"]["down_floats_per_client"], rows["fedavg"]["up_floats_per_client"]) == (sigma, sigma)
    assert rows["fedavg"]["down_bytes"] == rows["fedavg"]["up_bytes"] == 5 * 4 * sigma
    # FedRep: the body only, both ways
    assert rows["fedrep"]["down_floats_per_client"] == rows["fedrep"]["up_floats_per_client"] == sigma - head
    # FedFomo: the other 4 clients' models and their ids down; the model, its 4 weights and ids up
    assert rows["fedfomo"]["down_floats_per_client"] == 4 * sigma + 4
    assert rows["fedfomo"]["down_bytes"] == 5 * (4 * 4 * sigma + 8 * 4)
    assert rows["fedfomo"]["up_floats_per_client"] == sigma + 4 + 4
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["fedavg"]["mean_down_floats_per_client"] == sigma

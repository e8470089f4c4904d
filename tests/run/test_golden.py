"""Frozen golden numbers: FedAvg and FedALA, two rounds on the synthetic problem, loop engine.

Recorded before the round-driver refactor and checked identical after it. The
tolerances sit between the last-bit spread of CPU kernels and small changes of the maths (measured with
``python benchmarks/golden_spread.py``, relative deviations from these numbers):

    reduction order changed (threads=2, engine=vmap, parallel)   losses <= 1.3e-7, sums <= 3.2e-8
    lr 0.05 -> 0.0501                                             losses    2.5e-4, sums    7.0e-3
    momentum 0 -> 0.001                                           losses    1.5e-4, sums    4.7e-3
    fedala.eta 1.0 -> 0.99                                        losses    3.0e-4, sums    1.4e-3

so losses and parameter checksums (float64 sums of the server's global model and of every
client's model) are compared at 1e-5 relative: ~75x above what another CPU's kernels can do
to two rounds (reassociation), ~15x below the smallest change of the maths measured.
Accuracies may move by one test sample of 252 (a near-tie argmax flipped by the last bit);
the losses and sums catch what such a flip hides.
"""

from __future__ import annotations

import json

import pytest
import torch

from pflkit.config import load_config
from pflkit.run.experiment import run_experiment

pytestmark = pytest.mark.integration

OVERRIDES = [
    "dataset=synthetic",
    "num_clients=4",
    "alpha=0.5",
    "rounds=2",
    "lr=0.05",
    "engine=loop",
    "fedala.max_start_epochs=5",
    'algorithms=["fedavg","fedala"]',
]

REL = 1e-5  # relative tolerance of losses and checksums (see the module docstring)
ONE_SAMPLE = 1 / 252 + 1e-12  # the four clients' test splits hold 252 samples

# (algorithm, round): (accuracy, test loss, train loss of that round)
RECORDS = {
    ("fedavg", 0): (0.0992063492063492, 2.3011147029816157, None),
    ("fedavg", 1): (0.0992063492063492, 2.2901714264400423, 2.211639360888818),
    ("fedavg", 2): (0.23015873015873015, 2.2758465115986173, 2.140723797123799),
    ("fedala", 0): (0.0992063492063492, 2.3011147029816157, None),
    ("fedala", 1): (0.2857142857142857, 2.2417205628894625, 2.211639360888818),
    ("fedala", 2): (0.29365079365079366, 2.184677820357065, 2.111312346009173),
}
# algorithm: (sum of the global model, sums of clients 0..3's models) after round 2
CHECKSUMS = {
    "fedavg": (19.82341581528135, [22.431304150301457, 14.8250131043892, 22.028957192893813, 19.528857859318578]),
    "fedala": (19.08944846588747, [21.64659916197843, 14.61829366005577, 21.045246071423662, 18.657184902505378]),
}


def test_fedavg_and_fedala_golden_numbers(tmp_path):
    run_experiment(load_config(None, OVERRIDES), tmp_path, progress=False, echo=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["algorithm"], r["round"]) for r in records] == list(RECORDS)
    for r in records:
        accuracy, test_loss, train_loss = RECORDS[(r["algorithm"], r["round"])]
        assert r["accuracy"] == pytest.approx(accuracy, abs=ONE_SAMPLE)
        assert r["test_loss"] == pytest.approx(test_loss, rel=REL)
        assert r.get("train_loss") == (None if train_loss is None else pytest.approx(train_loss, rel=REL))
    for name, (server_sum, client_sums) in CHECKSUMS.items():
        checkpoint = torch.load(tmp_path / "checkpoints" / f"{name}-seed0.pt", weights_only=True)
        total = lambda params: sum(float(v.double().sum()) for v in params.values())  # noqa: E731
        assert total(checkpoint["server"]["global"]) == pytest.approx(server_sum, rel=REL)
        for i, expected in enumerate(client_sums):
            assert total(checkpoint["clients"][i]["model"]) == pytest.approx(expected, rel=REL)

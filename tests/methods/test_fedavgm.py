"""FedAvgM: the server momentum by hand, and against my transcription of Flower 1.41's FedAvgM
(``flwr/serverapp/strategy/fedavgm.py``, ``aggregate_train``; tests/support/references.py), on random
uploads and on trained rounds."""

from __future__ import annotations

import pytest
import torch

from pflkit.algorithms.serveropt import OPTIMIZER
from tests.support.builders import build, params_of, tiny_context
from tests.support.references import FlowerFedAvgM, server_rounds, trained_rounds


def constant(params: dict, value: float) -> dict:
    return {k: torch.full_like(v, value) for k, v in params.items()}


def test_fedavgm_steps_the_momentum_of_the_averaged_update_by_hand():
    ctx = tiny_context()
    alg = build("fedavgm", ctx, "fedavgm.momentum=0.5", "fedavgm.server_lr=2.0")
    zero = constant(params_of(ctx, 0), 0.0)
    server = alg.init_server({**zero, "buffer": torch.zeros(3)})  # a statistic: averaged, never stepped
    ups = [
        {"params": {**constant(zero, 1.0), "buffer": torch.ones(3)}, "num_samples": 10, "client_id": 0},
        {"params": {**constant(zero, 3.0), "buffer": 3 * torch.ones(3)}, "num_samples": 30, "client_id": 1},
    ]
    server = alg.aggregate(server, ups, 1)  # Δ = 2.5, v = 2.5, w = 0 + 2 * 2.5
    for k in zero:
        torch.testing.assert_close(server["global"][k], torch.full_like(zero[k], 5.0))
        torch.testing.assert_close(server[OPTIMIZER]["momentum"][k], torch.full_like(zero[k], 2.5))
    torch.testing.assert_close(server["global"]["buffer"], torch.full((3,), 2.5))
    assert "buffer" not in server[OPTIMIZER]["momentum"]
    server = alg.aggregate(server, ups, 2)  # Δ = 2.5 − 5, v = 0.5 * 2.5 − 2.5, w = 5 + 2 * v
    for k in zero:
        torch.testing.assert_close(server["global"][k], torch.full_like(zero[k], 5.0 + 2 * (1.25 - 2.5)))


def test_fedavgm_without_momentum_at_rate_one_is_fedavg():
    ctx = tiny_context()
    glob = params_of(ctx, 0)
    ups = [{"params": params_of(ctx, 1 + i), "num_samples": 10 * (i + 1), "client_id": i} for i in range(3)]
    plain = build("fedavg", ctx).aggregate({"global": glob}, ups, 1)["global"]
    alg = build("fedavgm", ctx, "fedavgm.momentum=0.0")
    server = alg.aggregate(alg.init_server(glob), ups, 1)["global"]
    for k in glob:
        torch.testing.assert_close(server[k], plain[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("momentum, lr", [(0.9, 1.0), (0.9, 0.7), (0.0, 0.5)])
def test_fedavgm_matches_a_transcription_of_flowers_fedavgm_over_rounds(momentum, lr):
    server_rounds(
        "fedavgm",
        lambda initial: FlowerFedAvgM(initial, server_learning_rate=lr, server_momentum=momentum),
        f"fedavgm.momentum={momentum}",
        f"fedavgm.server_lr={lr}",
    )


def test_fedavgm_trained_rounds_match_flowers_fedavgm():
    trained_rounds("fedavgm", lambda initial: FlowerFedAvgM(initial, server_momentum=0.9))

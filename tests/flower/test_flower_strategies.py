"""pflkit's server optimisers against Flower's own strategies (flwr's ``FedAvgM``, ``FedAdagrad``,
``FedAdam``, ``FedYogi`` of ``flwr.server.strategy``), run on the same uploads: with Flower's options
(v from zero, FedAdam's bias correction, FedAdagrad without momentum) the global models agree round
after round."""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.server import strategy as flower  # noqa: E402

from tests.support.references import server_rounds, trained_rounds  # noqa: E402

pytestmark = pytest.mark.flower


class FlowerStrategy:
    """A Flower strategy fed pflkit's uploads: ``aggregate_fit`` on FitRes built from them (in the
    order given), its result as a parameter dict. ``configure_train`` sets a FedOpt strategy's current
    weights to the model the round sends (as Flower's ``serverapp`` FedOpt does in its own
    ``configure_train``); FedAvgM keeps its own."""

    def __init__(self, make, initial: dict) -> None:
        self.keys = list(initial)
        self.strategy = make(ndarrays_to_parameters([initial[k].numpy() for k in self.keys]))

    def configure_train(self, arrays: dict) -> None:
        if isinstance(self.strategy, flower.FedOpt):
            self.strategy.current_weights = [arrays[k].numpy().copy() for k in self.keys]

    def round(self, server_round: int, replies: list[tuple[dict, int]]) -> dict:
        import torch

        results = [
            (None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([p[k].numpy() for k in self.keys]), n, {}))
            for p, n in replies
        ]
        parameters, _ = self.strategy.aggregate_fit(server_round, results, [])
        arrays = parameters_to_ndarrays(parameters)
        return {k: torch.from_numpy(np.asarray(a, dtype=np.float32)) for k, a in zip(self.keys, arrays)}


CASES = {
    "fedavgm": (
        lambda p: flower.FedAvgM(initial_parameters=p, server_learning_rate=0.7, server_momentum=0.9),
        ("fedavgm.server_lr=0.7", "fedavgm.momentum=0.9"),
    ),
    "fedadagrad": (
        lambda p: flower.FedAdagrad(initial_parameters=p, eta=0.1, tau=1e-3),
        ("fedadagrad.server_lr=0.1", "fedadagrad.beta1=0.0", 'fedadagrad.initial_v="zero"'),
    ),
    "fedadam": (
        lambda p: flower.FedAdam(initial_parameters=p, eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3),
        ("fedadam.server_lr=0.1", "fedadam.bias_correction=true", 'fedadam.initial_v="zero"'),
    ),
    "fedyogi": (
        lambda p: flower.FedYogi(initial_parameters=p, eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3),
        ("fedyogi.server_lr=0.01", 'fedyogi.initial_v="zero"'),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_server_optimizers_give_the_numbers_of_flowers_own_strategies(name):
    make, overrides = CASES[name]
    server_rounds(name, lambda initial: FlowerStrategy(make, initial), *overrides)
    trained_rounds(name, lambda initial: FlowerStrategy(make, initial), *overrides)

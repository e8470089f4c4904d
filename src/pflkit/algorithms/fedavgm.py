"""FedAvgM (Hsu et al., 2019): FedAvg with server momentum.

The clients run FedAvg's round. The server takes the pseudo-gradient Δ = w_avg − w (the
sample-weighted average of the uploads minus the global model), keeps the momentum
v ← β v + Δ (v = 0 before round 1) and steps w ← w + η v. With β = 0 and η = 1 it is FedAvg.
"""

from __future__ import annotations

from pydantic import Field

from ..functional import Params
from .card import Choice, MethodCard, Paper
from .registry import register
from .serveropt import OptimizerState, ServerLearningRate, ServerOptimizer, flower_reference, zeros


class FedAvgMSettings(ServerLearningRate):
    momentum: float = Field(0.9, ge=0, lt=1, description="server momentum β")


@register
class FedAvgM(ServerOptimizer):
    name = "fedavgm"
    settings_class = FedAvgMSettings
    settings: FedAvgMSettings

    def init_optimizer(self, params: Params) -> OptimizerState:
        return {"momentum": zeros(params)}

    def update(self, state: OptimizerState, delta: Params, round: int) -> tuple[Params, OptimizerState]:
        beta, lr = self.settings.momentum, self.settings.server_lr
        v = {k: beta * state["momentum"][k] + d for k, d in delta.items()}
        return {k: lr * v[k] for k in v}, {"momentum": v}


FedAvgM.card = MethodCard(
    full_name="FedAvgM",
    paper=Paper(
        "Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification",
        "Hsu et al.",
        2019,
        "arXiv",
        "https://arxiv.org/abs/1909.06335",
    ),
    personalised=False,
    shares="The whole model and its training-set size, as FedAvg.",
    keeps="Nothing between rounds on the client. The server keeps its momentum v.",
    scored="the received global",
    client_round="Overwrite the local model with the received global. Train E epochs of SGD on "
    "cross-entropy. Upload the model. The server averages the uploads by sample count (w_avg), "
    "then steps v ← βv + (w_avg − w), w ← w + ηv.",
    references=(flower_reference("fedavgm"),),
    tests=(
        "tests/methods/test_fedavgm.py::test_fedavgm_matches_a_transcription_of_flowers_fedavgm_over_rounds",
        "tests/flower/test_flower_strategies.py::test_server_optimizers_give_the_numbers_of_flowers_own_strategies",
    ),
    differences=(
        "Flower's default momentum is 0 (then FedAvgM is FedAvg with a server learning rate); pflkit's is "
        "0.9, the value Hsu et al. and Reddi et al. use.",
        "Flower writes the pseudo-gradient as w − w_avg and steps w − ηv; pflkit writes Δ = w_avg − w and "
        "steps w + ηv: the same numbers.",
        "Flower steps every array of the model, batch-norm statistics too; pflkit steps the parameters and "
        "takes the average of the statistics, as FedAvg.",
    ),
    choices=(
        Choice("server momentum β", "0.9", "fedavgm.momentum"),
        Choice("server learning rate η (Hsu et al.: 1, the effective rate is η/(1 − β))", "1.0", "fedavgm.server_lr"),
    ),
    notes=("The momentum is part of the server state: checkpoints carry it and a resumed run continues it.",),
)

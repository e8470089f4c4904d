"""FedProx (Li et al., MLSys 2020): local objective F_i(w) + mu/2 ||w - w_global||^2.

The method is its loss: cross-entropy plus the proximal term toward the received global model.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..functional.training import LossFn, classification_loss, proximal_loss
from .base import Algorithm, ClientContext, Payload, Settings, State
from .card import MethodCard, Paper, Reference
from .registry import register


class FedProxSettings(Settings):
    mu: float = Field(0.001, ge=0, description="proximal coefficient (FedALA App. G: 0.001)")


@register
class FedProx(Algorithm):
    name = "fedprox"
    settings_class = FedProxSettings
    settings: FedProxSettings

    def loss(self) -> LossFn:
        return proximal_loss(classification_loss, self.settings.mu)

    def loss_aux(self, payload: Payload, state: State, ctx: ClientContext) -> Any:
        return {"anchor": self.parameters_of(payload["global"])}


FedProx.card = MethodCard(
    full_name="FedProx",
    paper=Paper(
        "Federated Optimization in Heterogeneous Networks",
        "Li et al.",
        2020,
        "MLSys",
        "https://arxiv.org/abs/1812.06127",
    ),
    personalised=False,
    shares="The whole model and its training-set size; the server averages them as FedAvg.",
    keeps="Nothing between rounds.",
    scored="the received global",
    client_round="Overwrite the local model with the received global. Train E epochs of SGD on "
    "F + μ/2‖w − w_g‖², the proximal term pulling toward the received global (μ = 0.001). Upload "
    "the model.",
    references=(
        Reference(
            "TsingZ0/PFLlib",
            "f1e313a",
            ("clients/clientprox.py", "optimizers/fedoptimizer.py (PerturbedGradientDescent)"),
        ),
    ),
    tests=(
        "tests/methods/test_fedprox.py::test_fedprox_is_pfllib_perturbed_gradient_descent_toward_the_received_global",
    ),
    differences=("None. μ = 0.001 is FedALA Appendix G's value; PFLlib's command-line default is 0.",),
    notes=("`train_loss` includes the proximal term.",),
    ala_initialises="the local model; the proximal anchor stays the received global",
)

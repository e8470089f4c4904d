"""FedProx-C (FedALA paper baseline, reconstructed: the paper gives no code): FedProx plus local
fine-tuning of the downloaded global model before evaluation and training (see ``fedavgc``).

Fine-tuning is plain SGD unless ``ft_prox`` adds FedProx's proximal term to it (the paper does not
say which; the method's page, docs/reference/methods/fedproxc.md, lists the choices);
local training then minimises F_i(w) + mu/2 ||w - w_global||^2. Evaluated model: the fine-tuned
one. With ``+ala`` ALA initialises the local model, which is then fine-tuned.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..functional.training import LossFn, classification_loss, proximal_loss
from .base import ClientContext, Payload, State
from .card import Choice, MethodCard
from .fedavgc import FEDALA_PAPER, FINE_TUNING_CHOICES, FineTuneSettings, FineTuning
from .registry import register


class FedProxCSettings(FineTuneSettings):
    mu: float = Field(0.001, ge=0, description="proximal coefficient (FedALA App. G: 0.001)")
    ft_prox: bool = Field(False, description="fine-tune with the proximal term too")


@register
class FedProxC(FineTuning):
    name = "fedproxc"
    settings_class = FedProxCSettings
    settings: FedProxCSettings

    def loss(self) -> LossFn:
        return proximal_loss(classification_loss, self.settings.mu)

    def loss_aux(self, payload: Payload, state: State, ctx: ClientContext) -> Any:
        return {"anchor": self.parameters_of(payload["global"])}

    def finetune_loss(self) -> LossFn:
        return self.loss() if self.settings.ft_prox else classification_loss


FedProxC.card = MethodCard(
    full_name="FedProx-C",
    paper=FEDALA_PAPER,
    personalised=True,
    shares="The whole model and its training-set size; the server averages them as FedAvg.",
    keeps="Nothing between rounds: the received global model overwrites the local one.",
    scored="the fine-tuned model",
    client_round="As FedAvg-C, with FedProx training after fine-tuning (μ = 0.001). Fine-tuning is plain "
    "SGD unless `ft_prox` adds the proximal term to it.",
    no_reference="No author code exists: the FedALA paper, which uses it as a baseline, only says the "
    "global model is locally fine-tuned.",
    tests=("tests/methods/test_fedavgc.py::test_finetuned_methods_evaluate_the_finetuned_global_and_train_from_it",),
    choices=(*FINE_TUNING_CHOICES, Choice("proximal term while fine-tuning", "off", "`fedproxc.ft_prox`")),
    reconstruction=True,
    ala_initialises="the local model, which is then fine-tuned",
)

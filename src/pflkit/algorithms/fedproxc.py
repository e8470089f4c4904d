"""FedProx-C (FedALA paper baseline, spec §2.3 [RECON]): FedProx plus local fine-tuning of the
downloaded global model before evaluation and training (see ``fedavgc``).

Fine-tuning is plain SGD unless ``ft_prox`` adds FedProx's proximal term to it [UNCERTAIN];
local training then minimises F_i(w) + mu/2 ||w - w_global||^2. Evaluated model: the fine-tuned
one. With ``+ala`` ALA initialises the local model, which is then fine-tuned.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..functional.training import LossFn, classification_loss, proximal_loss
from .base import ClientContext, Payload, State
from .fedavgc import FineTuneSettings, FineTuning
from .registry import register


class FedProxCSettings(FineTuneSettings):
    mu: float = Field(0.001, ge=0, description="proximal coefficient (FedALA App. G: 0.001)")
    ft_prox: bool = Field(False, description="fine-tune with the proximal term too [the paper leaves it open]")


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

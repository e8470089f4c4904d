"""FedProx-C (FedALA paper baseline, spec §2.3 [RECON]): FedProx plus local fine-tuning of the
downloaded global model before evaluation and training (see ``fedavgc``).

Fine-tuning is plain SGD unless ``ft_prox`` adds FedProx's proximal term to it [UNCERTAIN];
local training then minimises F_i(w) + mu/2 ||w - w_global||^2. Evaluated model: the fine-tuned
one. With ``+ala`` ALA initialises the local model, which is then fine-tuned.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .base import Algorithm, ClientContext, Payload, State, Upload
from .fedavgc import FineTuneSettings, FineTuning
from .registry import register


class FedProxCSettings(FineTuneSettings):
    mu: float = Field(0.001, ge=0, description="proximal coefficient (FedALA App. G: 0.001)")
    ft_prox: bool = Field(False, description="fine-tune with the proximal term too [UNCERTAIN, spec §2.3]")


@register
class FedProxC(FineTuning, Algorithm):
    name = "fedproxc"
    settings_class = FedProxCSettings
    settings: FedProxCSettings

    def finetune_prox(self, payload: Payload) -> dict[str, Any]:
        return {"prox_anchor": payload["global"], "prox_mu": self.settings.mu} if self.settings.ft_prox else {}

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        params, loss = ctx.sgd(self.training_start(payload, state), epochs=self.train.local_epochs,
                               prox_anchor=payload["global"], prox_mu=self.settings.mu)
        return {**state, "model": params}, self.upload(params, ctx), {"train_loss": loss}

"""FedProx (Li et al., MLSys 2020): local objective F_i(w) + mu/2 ||w - w_global||^2 (spec §2.2).

The method is its loss: cross-entropy plus the proximal term toward the received global model.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..functional.training import LossFn, classification_loss, proximal_loss
from .base import Algorithm, ClientContext, Payload, Settings, State
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

"""FedProx (Li et al., MLSys 2020): local objective F_i(w) + mu/2 ||w - w_global||^2 (spec §2.2)."""

from __future__ import annotations

from pydantic import Field

from .base import Algorithm, ClientContext, Payload, Settings, State, Upload
from .registry import register


class FedProxSettings(Settings):
    mu: float = Field(0.001, ge=0, description="proximal coefficient (FedALA App. G: 0.001)")


@register
class FedProx(Algorithm):
    name = "fedprox"
    settings_class = FedProxSettings
    settings: FedProxSettings

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        params, loss = ctx.sgd(state["model"], epochs=self.train.local_epochs, prox_anchor=payload["global"],
                               prox_mu=self.settings.mu)
        return {**state, "model": params}, self.upload(params, ctx), {"train_loss": loss}

"""FedProx (Li et al., MLSys 2020): local objective F_i(w) + mu/2 ||w - w_global||^2 (spec §2.2)."""

from __future__ import annotations

from pydantic import Field

from ..functional import sgd
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
        params, loss = sgd(ctx.model, state["model"], ctx.batches("train", self.train.local_epochs),
                           self.train.lr, prox_anchor=payload["global"], prox_mu=self.settings.mu,
                           where=ctx.where("local training"))
        return {**state, "model": params}, self.upload(params, ctx), {"train_loss": loss}

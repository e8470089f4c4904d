"""Ditto (Li et al., ICML 2021): a global model plus a proximally regularised personal model.

Per round (reference order, spec §2.7): (a) ``personal_epochs`` epochs of SGD on
F_i(v) + lambda/2 ||v - w_global||^2 for the personal model v (anchor = received global);
(b) E epochs of plain SGD from the received global -> upload. Evaluated model: v.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..functional import clone
from ..functional.params import Params
from .base import Algorithm, ClientContext, Payload, Settings, State, Upload
from .registry import register


class DittoSettings(Settings):
    mu: float = Field(0.1, ge=0, description="lambda of the personal proximal term (App. G: 0.1)")
    personal_epochs: int = Field(2, ge=1, description="s, epochs of personal training per round (App. G: 2)")
    ala_target: Literal["model", "personal"] = Field(
        "model", description="with +ala: which copy ALA initialises: the global-track model (spec §1.8 "
        "[RECON]) or the personal model (FedALA author, TsingZ0/FedALA issue #9)")


@register
class Ditto(Algorithm):
    name = "ditto"
    settings_class = DittoSettings
    settings: DittoSettings
    ala_targets = {"model": ("global", "model"), "personal": ("global", "personal")}

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": clone(init_params), "personal": clone(init_params)}

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        personal, personal_loss = ctx.sgd(state["personal"], purpose="personal",
                                          epochs=self.settings.personal_epochs, prox_anchor=payload["global"],
                                          prox_mu=self.settings.mu, stage="personal training")
        params, loss = ctx.sgd(state["model"], epochs=self.train.local_epochs)
        return ({**state, "model": params, "personal": personal}, self.upload(params, ctx),
                {"train_loss": loss, "personal_loss": personal_loss})

    def eval_params(self, state: State) -> Params:
        return state["personal"]

"""FedRep (Collins et al., ICML 2021): shared body, per-client head (spec §2.5).

Round: take the global body; train the head alone for ``head_epochs`` epochs, then the body
alone for E epochs; upload the body only. Evaluated model: (latest global body, local head).
"""

from __future__ import annotations

from pydantic import Field

from ..functional import sgd, subset
from ..models import head_names
from .base import Algorithm, ClientContext, Payload, Settings, State, Upload
from .registry import register


class FedRepSettings(Settings):
    head_epochs: int = Field(5, ge=1, description="tau, head-only epochs per round (App. G: 5)")


@register
class FedRep(Algorithm):
    name = "fedrep"
    settings_class = FedRepSettings
    settings: FedRepSettings

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        """Only the body travels; heads stay on the clients."""
        head = set(head_names(self.units))
        return {"global": {k: v for k, v in server["global"].items() if k not in head}}

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        head = head_names(self.units)
        body = [k for k in state["model"] if k not in head]
        params, head_loss = sgd(ctx.model, state["model"], ctx.batches("head", self.settings.head_epochs),
                                self.train.lr, trainable=head, where=ctx.where("head training"))
        params, loss = sgd(ctx.model, params, ctx.batches("train", self.train.local_epochs),
                           self.train.lr, trainable=body, where=ctx.where("body training"))
        return ({**state, "model": params}, self.upload(subset(params, body), ctx),
                {"train_loss": loss, "head_loss": head_loss})

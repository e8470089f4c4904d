"""FedRep (Collins et al., ICML 2021): shared body, per-client head (spec §2.5).

Round: take the global body; train the head alone for ``head_epochs`` epochs, then the body
alone for E epochs; upload the body only. Evaluated model: (latest global body, local head).
"""

from __future__ import annotations

from pydantic import Field

from ..functional import subset
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

    def downloaded_names(self, names: list[str]) -> list[str]:
        """Only the body travels; heads stay on the clients."""
        head = set(head_names(self.units))
        return [n for n in super().downloaded_names(names) if n not in head]

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        head = head_names(self.units)
        body = [k for k in state["model"] if k not in head]
        params, head_loss = ctx.sgd(state["model"], purpose="head", epochs=self.settings.head_epochs,
                                    trainable=head, stage="head training")
        params, loss = ctx.sgd(params, epochs=self.train.local_epochs, trainable=body, stage="body training")
        return ({**state, "model": params}, self.upload(subset(params, body), ctx),
                {"train_loss": loss, "head_loss": head_loss})

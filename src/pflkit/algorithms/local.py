"""Local training only: every client trains its own model alone and never communicates.

The floor every pFL method must beat. The server keeps Theta^0 untouched; nothing is sent or
aggregated. Evaluated model: the client's own model. No ALA (nothing is downloaded).
"""

from __future__ import annotations

from .base import Algorithm, ClientContext, Payload, State, Upload
from .registry import register


@register
class Local(Algorithm):
    name = "local"
    ala_targets = {}

    def downloaded_names(self, names: list[str]) -> list[str]:
        return []

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        return {}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        return state

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        return server

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        params, loss = ctx.sgd(state["model"], epochs=self.train.local_epochs)
        return {**state, "model": params}, self.upload({}, ctx), {"train_loss": loss}

"""Local training only: every client trains its own model alone and never communicates.

The floor every pFL method must beat. The server keeps Theta^0 untouched; nothing is sent or
aggregated. Evaluated model: the client's own model. No ALA (nothing is downloaded).
"""

from __future__ import annotations

from .base import Algorithm, ClientContext, Init, Payload, SentUpload, State, Trained
from .card import MethodCard
from .registry import register


@register
class Local(Algorithm):
    name = "local"
    has_global_model = False  # nothing is aggregated
    newcomer_refusal = "local trains no shared model, so a client that never trained has only the initial model"
    ala_targets = {}

    def downloaded_names(self, names: list[str]) -> list[str]:
        return []

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        return {}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        return state, {}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        return server

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        fit = self.train_model(state["model"], ctx, self.loss())
        return {**state, "model": fit.params}, self.upload({}, ctx), {"train_loss": fit.loss}


Local.card = MethodCard(
    full_name="Local training",
    paper=None,
    personalised=True,
    shares="Nothing.",
    keeps="Its own model.",
    scored="the own model",
    client_round="Train E epochs on the own model. Nothing is sent. The floor every personalised method must beat.",
    no_reference="A baseline: the clients never communicate.",
    tests=("tests/methods/test_local.py::test_local_training_never_communicates",),
)

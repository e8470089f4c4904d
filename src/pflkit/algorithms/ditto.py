"""Ditto (Li et al., ICML 2021): a global model plus a proximally regularised personal model.

Per round (reference order): (a) ``personal_epochs`` epochs of SGD on
F_i(v) + lambda/2 ||v - w_global||^2 for the personal model v (anchor = received global);
(b) E epochs of plain SGD from the received global -> upload. Evaluated model: v.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..functional import Params, clone
from ..functional.training import classification_loss, proximal_loss
from .base import Algorithm, ClientContext, ModelState, Payload, Settings, State, Trained
from .card import MethodCard, Paper, Reference
from .registry import register


class DittoSettings(Settings):
    mu: float = Field(0.1, ge=0, description="lambda of the personal proximal term (App. G: 0.1)")
    personal_epochs: int = Field(2, ge=1, description="s, epochs of personal training per round (App. G: 2)")
    ala_target: Literal["model", "personal"] = Field(
        "model",
        description="with +ala: which copy ALA initialises: the global-track model "
        "or the personal model (the FedALA author's answer)",
    )


class DittoState(ModelState):
    personal: Params


@register
class Ditto(Algorithm):
    name = "ditto"
    settings_class = DittoSettings
    settings: DittoSettings
    ala_targets = {"model": ("global", "model"), "personal": ("global", "personal")}

    def init_client(self, init_params: Params, client_id: int) -> State:
        # the ignore below: a TypedDict is no dict[str, Any] (State) to mypy
        return DittoState(model=clone(init_params), personal=clone(init_params))  # type: ignore[return-value]

    def newcomer_state(self, init_params: Params, payload: Payload, client_id: int) -> State:
        """A newcomer's personal model starts from the received global model (a participant's starts
        from the initial one and is trained every round)."""
        state = self.init_client(init_params, client_id)
        return {**state, "personal": {**state["personal"], **clone(payload["global"])}}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        personal = self.train_model(
            state["personal"],
            ctx,
            proximal_loss(classification_loss, self.settings.mu),
            aux={"anchor": self.parameters_of(payload["global"])},
            purpose="personal",
            epochs=self.settings.personal_epochs,
            stage="personal training",
        )
        fit = self.train_model(state["model"], ctx, classification_loss)
        return (
            {**state, "model": fit.params, "personal": personal.params},
            self.upload(fit.params, ctx),
            {"train_loss": fit.loss, "personal_loss": personal.loss},
        )

    def eval_params(self, state: State) -> Params:
        return state["personal"]


Ditto.card = MethodCard(
    full_name="Ditto",
    paper=Paper(
        "Ditto: Fair and Robust Federated Learning Through Personalization",
        "Li et al.",
        2021,
        "ICML",
        "https://arxiv.org/abs/2012.04221",
    ),
    personalised=True,
    shares="The global-track model and its training-set size.",
    keeps="The personal model v.",
    scored="the personal model v",
    scored_detail="v before this round's personal update.",
    client_round="Train the personal model v for s = 2 epochs on F + λ/2‖v − w_g‖² (λ = 0.1), anchored "
    "at the received global. Then train the global track from the received global for E epochs. "
    "Upload the global track.",
    references=(
        Reference(
            "TsingZ0/PFLlib",
            "f1e313a",
            ("clients/clientditto.py (ptrain, train, test_metrics)", "servers/serverditto.py"),
        ),
    ),
    tests=(
        "tests/methods/test_ditto.py::"
        "test_ditto_is_pfllib_ptrain_then_train_with_the_personal_model_anchored_at_the_received_global",
    ),
    differences=(
        "None in the updates or the scored model. Later PFLlib versions score differently "
        "(docs/explanations/reconstructions.md).",
    ),
    notes=("`train_loss` includes the personal model's proximal term.",),
    ala_initialises='the global-track copy (`ditto.ala_target = "model"`, default), or the personal '
    'model (`"personal"`, the FedALA author\'s answer)',
)

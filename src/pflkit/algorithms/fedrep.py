"""FedRep (Collins et al., ICML 2021): shared body, per-client head (spec §2.5).

Round: take the global body; train the head alone for ``head_epochs`` epochs, then the body
alone for E epochs; upload the body only. Evaluated model: (latest global body, local head).
The head epochs run on the body's outputs, computed once per round (``cache_features``): the body
is frozen then, so every head step sees the same inputs as a step through the whole model.
"""

from __future__ import annotations

from pydantic import Field

from ..functional import subset
from ..functional.training import classification_loss
from ..models import head_names
from .base import Algorithm, ClientContext, Payload, Settings, State, Trained
from .registry import register


class FedRepSettings(Settings):
    head_epochs: int = Field(5, ge=1, description="tau, head-only epochs per round (App. G: 5)")
    clip_norm: float = Field(
        10.0,
        ge=0,
        description="clip each step's gradient at this global L2 norm in both "
        "phases (pflkit's, not the paper's or PFLlib's: at FedALA's lr 0.1 unclipped "
        "FedRep blows up at some seeds; 0: off, PFLlib's)",
    )
    cache_features: bool = Field(
        True,
        description="head epochs on the body's outputs computed once per round "
        "(the body is frozen then; the same function, far fewer forward passes); "
        "false: the whole model runs at every head step, as PFLlib does",
    )


@register
class FedRep(Algorithm):
    name = "fedrep"
    has_global_model = False  # the server never trains a head
    settings_class = FedRepSettings
    settings: FedRepSettings

    def downloaded_names(self, names: list[str]) -> list[str]:
        """Only the body travels; heads stay on the clients."""
        head = set(head_names(self.units))
        return [n for n in super().downloaded_names(names) if n not in head]

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        head = head_names(self.units)
        body = [k for k in state["model"] if k not in head]
        opt = ctx.train.optimizer(clip_norm=self.settings.clip_norm or None)
        head_fit = self.train_model(
            state["model"],
            ctx,
            classification_loss,
            purpose="head",
            epochs=self.settings.head_epochs,
            trainable=head,
            stage="head training",
            optimizer=opt,
            start=len(self.units) - 1 if self.settings.cache_features else 0,
        )
        fit = self.train_model(
            head_fit.params, ctx, classification_loss, trainable=body, stage="body training", optimizer=opt
        )
        return (
            {**state, "model": fit.params},
            self.upload(subset(fit.params, body), ctx),
            {"train_loss": fit.loss, "head_loss": head_fit.loss},
        )

"""FedAvg-C (FedALA paper baseline, spec §2.3 [RECON]): FedAvg plus local fine-tuning of the
downloaded global model before evaluation and training.

No code is public; the paper only says the global model is "locally fine-tuned for local
initialisation at each iteration". Here: after receiving Theta^{t-1} the client fine-tunes all
parameters for ``ft_epochs`` epochs of SGD at the local lr (or until the epoch loss settles, like
ALA's start phase); the fine-tuned model is evaluated and is the start of local training.
Evaluated model: the fine-tuned one. With ``+ala`` ALA initialises the local model, which is
then fine-tuned.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from .base import Algorithm, ClientContext, Payload, Settings, State, Upload
from .registry import register


class FineTuneSettings(Settings):
    ft_epochs: int = Field(1, ge=1, description="fine-tuning epochs per round [UNCERTAIN, spec §2.3]")
    ft_until_converged: bool = Field(False, description="fine-tune until the std of the last ft_window epoch "
                                     "losses < ft_threshold (ALA's criterion, spec §1.6), capped by ft_max_epochs")
    ft_threshold: float = Field(0.01, gt=0, description="convergence threshold with ft_until_converged")
    ft_window: int = Field(10, ge=2, description="epochs in the convergence window")
    ft_max_epochs: int = Field(50, ge=1, description="cap on fine-tuning epochs with ft_until_converged")
    upload_from: Literal["finetuned", "global"] = Field(
        "finetuned", description="start local training from the fine-tuned or the raw received model "
        "[UNCERTAIN, spec §2.3]")


class FineTuning:
    """Mixin: fine-tune the received model in ``after_receive``; local training starts from it."""

    settings: FineTuneSettings

    @property
    def supports_batching(self) -> bool:  # type: ignore[override]
        return not self.settings.ft_until_converged  # per-client stopping runs clients one by one

    def finetune_prox(self, payload: Payload) -> dict[str, Any]:
        """Proximal term of the fine-tuning objective: none (FedProx-C may add its own)."""
        return {}

    def after_receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        cfg = self.settings
        prox = self.finetune_prox(payload)
        if not cfg.ft_until_converged:
            tuned, loss = ctx.sgd(state["model"], purpose="finetune", epochs=cfg.ft_epochs, stage="fine-tuning",
                                  **prox)
            ctx.info["ft_loss"] = loss
            return {**state, "model": tuned}
        params, losses = state["model"], []
        for epoch in range(cfg.ft_max_epochs):
            params, loss = ctx.sgd(params, purpose=f"finetune-{epoch}", stage="fine-tuning", **prox)
            losses.append(float(loss))
            if len(losses) >= cfg.ft_window and np.std(losses[-cfg.ft_window:]) < cfg.ft_threshold:
                break
        ctx.info.update(ft_loss=losses[-1], ft_epochs=len(losses))
        return {**state, "model": params}

    def training_start(self, payload: Payload, state: State) -> dict[str, Any]:
        if self.settings.upload_from == "global":
            return {**state["model"], **payload["global"]}
        return state["model"]


@register
class FedAvgC(FineTuning, Algorithm):
    name = "fedavgc"
    settings_class = FineTuneSettings
    settings: FineTuneSettings

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        params, loss = ctx.sgd(self.training_start(payload, state), epochs=self.train.local_epochs)
        return {**state, "model": params}, self.upload(params, ctx), {"train_loss": loss}

"""FedAvg (McMahan et al., AISTATS 2017): overwrite, E epochs of SGD, sample-weighted average.

Evaluated model: the downloaded global model (spec §2.1), which is the local model right after
``local_init``.
"""

from __future__ import annotations

from .base import Algorithm, ClientContext, Payload, State, Upload
from .registry import register


@register
class FedAvg(Algorithm):
    name = "fedavg"

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        params, loss = ctx.sgd(state["model"], epochs=self.train.local_epochs)
        return {**state, "model": params}, self.upload(params, ctx), {"train_loss": loss}

"""FedLC (Zhang et al., ICML 2022): federated learning with label-distribution-calibrated logits
(spec §3.14).

Local objective: cross-entropy on the calibrated logits z_j - tau * n_j^{-1/4}, with n_j the
client's training samples of class j; classes the client lacks (n_j = 0) are left out of the
softmax. Server: FedAvg.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params
from ..functional.training import Batch, LossFn, Net, label_loss
from .base import Algorithm, ClientContext, Payload, Settings, State
from .registry import register


class FedLCSettings(Settings):
    tau: float = Field(1.0, gt=0, description="calibration strength [the paper leaves it open]")


def calibrated_logits(logits: torch.Tensor, counts: torch.Tensor, tau: float) -> torch.Tensor:
    """z_j - tau * n_j^{-1/4}; classes with n_j = 0 get -inf (excluded)."""
    shift = tau * counts.clamp(min=1).to(logits.dtype) ** -0.25
    return (logits - shift).masked_fill(counts == 0, float("-inf"))


def fedlc_loss(tau: float) -> LossFn:
    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        z = calibrated_logits(net(params, batch.x), aux["counts"], tau)
        return label_loss(lambda y: F.cross_entropy(z, y, reduction="none"), batch)

    return loss


@register
class FedLC(Algorithm):
    name = "fedlc"
    settings_class = FedLCSettings
    settings: FedLCSettings

    def loss(self) -> LossFn:
        return fedlc_loss(self.settings.tau)

    def loss_aux(self, payload: Payload, state: State, ctx: ClientContext) -> Any:
        return {"counts": ctx.label_counts}

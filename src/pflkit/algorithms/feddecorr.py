"""FedDecorr (Shi et al., ICLR 2023): decorrelate the representations to fight dimensional
collapse (spec §3.14).

Local objective: CE + beta * ||K||_F^2 / d^2, with K the correlation matrix (d x d) of the batch's
z-scored representations (the body's output, the head's input). Server: FedAvg.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from ..functional import Params
from ..functional.training import Batch, LossFn, Net, cross_entropy
from .base import Algorithm, Settings
from .registry import register


class FedDecorrSettings(Settings):
    beta: float = Field(0.1, ge=0, description="weight of the decorrelation term (spec §3.14 [UNCERTAIN])")


def decorrelation(h: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """||K||_F^2 / d^2 for the correlation matrix K of the rows of ``h`` [b, d] (real rows: ``mask``);
    0 for a single sample."""
    h = h.flatten(1)
    w = torch.ones(len(h), dtype=h.dtype, device=h.device) if mask is None else mask.to(h.dtype)
    n = w.sum()
    mean = (w[:, None] * h).sum(0) / n
    centred = (h - mean) * w[:, None]
    var = (centred ** 2).sum(0) / n
    z = centred / torch.sqrt(var + eps)
    K = z.t() @ z / n
    d = h.shape[1]
    return torch.where(n > 1, (K ** 2).sum() / (d * d), torch.zeros((), dtype=h.dtype, device=h.device))


def feddecorr_loss(beta: float, body: int) -> LossFn:
    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        h = net(params, batch.x, stop=body)
        return cross_entropy(net(params, h, start=body), batch) + beta * decorrelation(h, batch.mask)
    return loss


@register
class FedDecorr(Algorithm):
    name = "feddecorr"
    settings_class = FedDecorrSettings
    settings: FedDecorrSettings

    def loss(self) -> LossFn:
        return feddecorr_loss(self.settings.beta, body=len(self.units) - 1)

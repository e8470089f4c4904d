"""FedAdagrad (Reddi et al., ICLR 2021, Algorithm 2): Adagrad on the server.

The clients run FedAvg's round. The server takes the pseudo-gradient Δ = w_avg − w and steps
m ← β1 m + (1 − β1) Δ, v ← v + Δ², w ← w + η m / (√v + τ) (``AdaptiveOptimizer``).
"""

from __future__ import annotations

import torch
from pydantic import Field

from .registry import register
from .serveropt import AdaptiveOptimizer, AdaptiveSettings, adaptive_card


class FedAdagradSettings(AdaptiveSettings):
    server_lr: float = Field(0.1, gt=0, description="server learning rate η")


@register
class FedAdagrad(AdaptiveOptimizer):
    name = "fedadagrad"
    settings_class = FedAdagradSettings
    settings: FedAdagradSettings

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        return v + square


FedAdagrad.card = adaptive_card(
    "FedAdagrad",
    FedAdagrad,
    "v ← v + Δ²",
    differences=(
        "Flower's FedAdagrad has no momentum (β1 = 0); Algorithm 2 has β1, and pflkit's default is 0.9. "
        "`fedadagrad.beta1 = 0` is Flower's form.",
    ),
)

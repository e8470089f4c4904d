"""FedYogi (Reddi et al., ICLR 2021, Algorithm 2): Yogi on the server.

The clients run FedAvg's round. The server takes the pseudo-gradient Δ = w_avg − w and steps
m ← β1 m + (1 − β1) Δ, v ← v − (1 − β2) Δ² sign(v − Δ²), w ← w + η m / (√v + τ)
(``AdaptiveOptimizer``).
"""

from __future__ import annotations

import torch
from pydantic import Field

from .registry import register
from .serveropt import AdaptiveOptimizer, DecaySettings, adaptive_card


class FedYogiSettings(DecaySettings):
    server_lr: float = Field(0.01, gt=0, description="server learning rate η")


@register
class FedYogi(AdaptiveOptimizer):
    name = "fedyogi"
    settings_class = FedYogiSettings
    settings: FedYogiSettings

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.settings.beta2) * square * torch.sign(v - square)


FedYogi.card = adaptive_card(
    "FedYogi",
    FedYogi,
    "v ← v − (1 − β2) Δ² sign(v − Δ²)",
)

"""FedAdam (Reddi et al., ICLR 2021, Algorithm 2): Adam on the server.

The clients run FedAvg's round. The server takes the pseudo-gradient Δ = w_avg − w and steps
m ← β1 m + (1 − β1) Δ, v ← β2 v + (1 − β2) Δ², w ← w + η m / (√v + τ) (``AdaptiveOptimizer``).
Algorithm 2 has no bias correction; ``bias_correction = true`` scales η as Flower's FedAdam does.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from .registry import register
from .serveropt import AdaptiveOptimizer, DecaySettings, adaptive_card


class FedAdamSettings(DecaySettings):
    server_lr: float = Field(0.01, gt=0, description="server learning rate η")
    bias_correction: bool = Field(
        False,
        description="scale η in round t by √(1 − β2^(t+1)) / (1 − β1^(t+1)), as Flower's FedAdam "
        "(Algorithm 2: no correction)",
    )


@register
class FedAdam(AdaptiveOptimizer):
    name = "fedadam"
    settings_class = FedAdamSettings
    settings: FedAdamSettings

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        beta2 = self.settings.beta2
        return beta2 * v + (1 - beta2) * square

    def learning_rate(self, round: int) -> float:
        s = self.settings
        if not s.bias_correction:
            return s.server_lr
        return s.server_lr * math.sqrt(1 - s.beta2 ** (round + 1)) / (1 - s.beta1 ** (round + 1))


FedAdam.card = adaptive_card(
    "FedAdam",
    FedAdam,
    "v ← β2 v + (1 − β2) Δ²",
    differences=(
        "Flower's FedAdam scales η in round t by √(1 − β2^(t+1)) / (1 − β1^(t+1)) (Adam's bias correction, "
        "with the exponent one round ahead); Algorithm 2 has no correction. `fedadam.bias_correction = true` "
        "is Flower's form.",
        "Flower's default η is 0.1; pflkit's is 0.01 (the paper tunes η per task).",
    ),
)

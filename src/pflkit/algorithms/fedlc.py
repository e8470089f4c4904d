"""FedLC (Zhang et al., ICML 2022): federated learning with label-distribution-calibrated logits
(a baseline of the FedACD paper).

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
from .card import Choice, MethodCard, Paper, Reference
from .registry import register


class FedLCSettings(Settings):
    tau: float = Field(1.0, gt=0, description="calibration strength")


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


FedLC.card = MethodCard(
    full_name="FedLC",
    paper=Paper(
        "Federated Learning with Label Distribution Skew via Logits Calibration",
        "Zhang et al.",
        2022,
        "ICML",
        "https://proceedings.mlr.press/v162/zhang22p.html",
    ),
    personalised=False,
    shares="The whole model and its training-set size; the server averages them as FedAvg.",
    keeps="Nothing between rounds.",
    scored="the received global",
    client_round="Overwrite the local model with the received global. Train on cross-entropy of the "
    "calibrated logits z_j − τ n_j^{−1/4} (absent classes left out, τ = 1). Upload the model.",
    references=(Reference("KarhouTam/FL-bench", "06e658b", ("src/client/fedlc.py",)),),
    no_reference="The authors published no code; FL-bench's port is the reference.",
    tests=("tests/methods/test_fedlc.py::test_fedlc_matches_fl_benchs_calibrated_loss_and_client",),
    differences=(
        "The test runs τ = 1 and 2.",
        "FL-bench counts a class the client lacks as 1e-8, so it stays in the softmax with weight e^(−100τ). "
        "pflkit leaves it out. The two are equal in float32 for τ ≥ 0.2 while an absent class's logit is not "
        "far above the present ones'.",
        "The paper's loss leaves the true class out of the softmax denominator. FL-bench keeps the ordinary "
        "softmax (its code notes that training collapsed with the paper's form), and pflkit follows FL-bench.",
    ),
    choices=(Choice("calibration strength τ", "1", "`fedlc.tau`"),),
)

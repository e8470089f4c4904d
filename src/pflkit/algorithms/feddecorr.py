"""FedDecorr (Shi et al., ICLR 2023): decorrelate the representations to fight dimensional
collapse.

Local objective: CE + beta * L_decorr of the batch's representations h [N, d] (the body's output,
the head's input). Server: FedAvg.

``form = "reference"`` (default) is the authors' loss (bytedance/FedDecorr ``loss.py``, commit
973e4af): z-score each dimension with the unbiased variance (eps 1e-8 inside the root), M = z^T z
(not divided by N), the mean of M's squared off-diagonal entries, divided by N. ``form = "paper"``
is the paper's ||K||_F^2 / d^2 with K = z^T z / N (biased variance, eps 1e-5). Their gradients point
the same way; the reference's is (N-1)^2 d / (N (d-1)) times larger (about 62 at N = 64, d = 192),
and beta = 0.1 (CIFAR-10, Tiny-ImageNet; 0.05 on CIFAR-100) was tuned on the reference's scale.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from ..functional import Params
from ..functional.training import Batch, LossFn, Net, cross_entropy
from .base import Algorithm, Settings
from .card import Choice, MethodCard, Paper, Reference
from .registry import register


class FedDecorrSettings(Settings):
    beta: float = Field(
        0.1,
        ge=0,
        description="weight of the decorrelation term (the authors' CIFAR-10 and "
        "Tiny-ImageNet value; 0.05 on CIFAR-100)",
    )
    form: Literal["reference", "paper"] = Field(
        "reference",
        description="reference: the authors' loss.py (mean squared off-diagonal of the unnormalised "
        "z^T z, divided by the batch size); paper: ||K||_F^2 / d^2 (about N times weaker)",
    )


def decorrelation(h: torch.Tensor, mask: torch.Tensor | None = None, form: str = "reference") -> torch.Tensor:
    """The decorrelation loss of the rows of ``h`` [N, d] (real rows: ``mask``); 0 for a single
    sample. ``form``: "reference" (the authors' code) or "paper" (||K||_F^2 / d^2), see the module."""
    h = h.flatten(1)
    w = torch.ones(len(h), dtype=h.dtype, device=h.device) if mask is None else mask.to(h.dtype)
    n = w.sum()
    mean = (w[:, None] * h).sum(0) / n
    centred = (h - mean) * w[:, None]
    d = h.shape[1]
    if form == "paper":
        z = centred / torch.sqrt((centred**2).sum(0) / n + 1e-5)
        value = ((z.t() @ z / n) ** 2).sum() / (d * d)
    else:
        z = centred / torch.sqrt(1e-8 + (centred**2).sum(0) / (n - 1).clamp(min=1))
        M = z.t() @ z
        off_diagonal = (M**2).sum() - (torch.diagonal(M) ** 2).sum()
        value = off_diagonal / max(d * (d - 1), 1) / n
    return torch.where(n > 1, value, torch.zeros((), dtype=h.dtype, device=h.device))


def feddecorr_loss(beta: float, body: int, form: str = "reference") -> LossFn:
    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        h = net(params, batch.x, stop=body)
        return cross_entropy(net(params, h, start=body), batch) + beta * decorrelation(h, batch.mask, form)

    return loss


@register
class FedDecorr(Algorithm):
    name = "feddecorr"
    settings_class = FedDecorrSettings
    settings: FedDecorrSettings

    def loss(self) -> LossFn:
        return feddecorr_loss(self.settings.beta, body=len(self.units) - 1, form=self.settings.form)


FedDecorr.card = MethodCard(
    full_name="FedDecorr",
    paper=Paper(
        "Towards Understanding and Mitigating Dimensional Collapse in Heterogeneous Federated Learning",
        "Shi et al.",
        2023,
        "ICLR",
        "https://arxiv.org/abs/2210.00226",
    ),
    personalised=False,
    shares="The whole model and its training-set size; the server averages them as FedAvg.",
    keeps="Nothing between rounds.",
    scored="the received global",
    client_round="Overwrite the local model with the received global. Train on CE + β·L of the batch's "
    "features h [N, d] (β = 0.1). L is the authors' `loss.py`: z-score h with the unbiased variance "
    "(ε = 1e-8), then the mean of the squared off-diagonal entries of zᵀz, divided by N. Upload the model.",
    references=(
        Reference("bytedance/FedDecorr", "973e4af", ("loss.py (FedDecorrLoss)", "approach/fedavg.py", "run_scripts/")),
    ),
    tests=(
        "tests/methods/test_feddecorr.py::test_decorrelation_is_the_authors_loss_and_the_papers_form_is_about_n_times_weaker",
        "tests/methods/test_feddecorr.py::test_feddecorr_batch_loss_is_ce_plus_beta_times_the_authors_loss_of_the_classifier_input",
        "tests/methods/test_feddecorr.py::test_feddecorr_client_round_is_the_authors_local_training",
    ),
    differences=(
        "None in the loss. The client round is checked under momentum 0.9 and weight decay 1e-5, at β = 0.1 and 0.05.",
        "Their runs use MobileNetV2 and ResNet features.",
    ),
    choices=(
        Choice(
            "weight β, loss form",
            "0.1 (the authors' CIFAR-10 and Tiny-ImageNet value; 0.05 on CIFAR-100), the authors' code's form. "
            "The paper's ‖K‖²_F/d² has the same gradient direction but is (N−1)²d/(N(d−1)) times weaker "
            "(62 at N = 64, d = 192), so β = 0.1 in it was nearly FedAvg.",
            '`feddecorr.beta`, `feddecorr.form = "paper"`',
        ),
    ),
)

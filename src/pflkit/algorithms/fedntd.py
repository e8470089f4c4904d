"""FedNTD (Lee et al., NeurIPS 2022): not-true distillation from the received global model
(a baseline of the FedACD paper).

Local objective: CE(z, y) + beta * tau^2 * KL(softmax(z^g_nt / tau) || softmax(z_nt / tau)), where
z_nt are the logits without the true class and z^g those of the frozen received global model
(evaluation mode). Server: FedAvg.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params
from ..functional.training import Batch, LossFn, Net, cross_entropy, label_loss, one_hot
from .base import Algorithm, ClientContext, Payload, Settings, State
from .card import MethodCard, Paper, Reference
from .registry import register


class FedNTDSettings(Settings):
    beta: float = Field(1.0, ge=0, description="weight of the not-true distillation term (FedNTD: 1)")
    tau: float = Field(1.0, gt=0, description="distillation temperature (FedNTD: 1)")


def not_true_kl(student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    """Per sample tau^2 * KL(softmax(teacher_nt / tau) || softmax(student_nt / tau)) over the classes
    other than ``y``; the true class is masked out of both (a large negative logit)."""
    true = one_hot(y, student.shape[-1]).bool()
    log_student = F.log_softmax(student.masked_fill(true, -1e9) / tau, dim=-1)
    teacher_probs = F.softmax(teacher.masked_fill(true, -1e9) / tau, dim=-1)
    return F.kl_div(log_student, teacher_probs, reduction="none").sum(-1) * tau * tau


def fedntd_loss(beta: float, tau: float) -> LossFn:
    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        logits = net(params, batch.x)
        with torch.no_grad():
            teacher = net(aux["teacher"], batch.x, train=False)
        ntd = label_loss(lambda y: not_true_kl(logits, teacher, y, tau), batch)
        return cross_entropy(logits, batch) + beta * ntd

    return loss


@register
class FedNTD(Algorithm):
    name = "fedntd"
    settings_class = FedNTDSettings
    settings: FedNTDSettings

    def loss(self) -> LossFn:
        return fedntd_loss(self.settings.beta, self.settings.tau)

    def loss_aux(self, payload: Payload, state: State, ctx: ClientContext) -> Any:
        return {"teacher": {**state["model"], **payload["global"]}}


FedNTD.card = MethodCard(
    full_name="FedNTD",
    paper=Paper(
        "Preservation of the Global Knowledge by Not-True Distillation in Federated Learning",
        "Lee et al.",
        2022,
        "NeurIPS",
        "https://arxiv.org/abs/2106.03097",
    ),
    personalised=False,
    shares="The whole model and its training-set size; the server averages them as FedAvg.",
    keeps="Nothing between rounds.",
    scored="the received global",
    client_round="Overwrite the local model with the received global. Train on CE + β τ² KL(not-true "
    "softmax of the received global ‖ of the local model) (β = τ = 1). Upload the model.",
    references=(
        Reference(
            "Lee-Gihun/FedNTD",
            "be00ee5",
            ("algorithms/fedntd/criterion.py (NTD_Loss)", "utils.py", "ClientTrainer.py", "config/fedntd.json"),
        ),
    ),
    tests=("tests/methods/test_fedntd.py::test_fedntd_matches_the_authors_ntd_loss_and_client",),
    differences=(
        "The test runs τ = β = 1 and τ = 3, β = 0.3.",
        "Their teacher runs in the mode the client model was left in. This differs only for a batch-norm "
        "model on the first client.",
        "Their teacher is a copy of the loaded global model, with the averaged batch-norm statistics. With "
        'the default `bn_buffers = "local"`, pflkit\'s runs with the client\'s own (`"global"` is theirs).',
    ),
)

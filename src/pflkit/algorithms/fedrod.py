"""FedROD (Chen & Chao, ICLR 2022): a generic model for the federation and a personal head per
client.

Local objective per batch: the balanced-softmax loss of the generic model (logits z_g + log n_j,
n_j the client's samples of class j; classes it lacks drop out), which trains the body and the
generic head, plus cross-entropy of z_g + z_p, where the personal head z_p sees the detached
features and z_g is detached, which trains the personal head only (as PFLlib's two optimisers on
one forward; the personal head's optimiser is plain SGD at the lr, without the run's momentum and
weight decay, as in both). The personal head starts as a copy of the initial head. Upload: body and generic
head; server: FedAvg. Global model: the generic one. Personalised model: the body with head
weights W_g + W_p (the sum of two linear heads' logits is one linear head).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from ..functional import Params, clone
from ..functional.training import Batch, LossFn, Net, cross_entropy, label_loss
from ..models import head_names
from .base import Algorithm, ClientContext, Payload, State, Trained
from .card import MethodCard, Paper, Reference
from .registry import register

PERSONAL = "fedrod.personal."  # prefix of the personal head among the tensors a fit trains


def fedrod_loss(body: int, head: list[str]) -> LossFn:
    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        h = net(params, batch.x, stop=body)
        z_g = net(params, h, start=body)
        balanced = z_g + torch.log(aux["counts"].to(z_g.dtype))  # log 0 = -inf: absent classes drop out
        generic = label_loss(lambda y: F.cross_entropy(balanced, y, reduction="none"), batch)
        z_p = net({**params, **{k: params[PERSONAL + k] for k in head}}, h.detach(), start=body)
        return generic + cross_entropy(z_g.detach() + z_p, batch)

    return loss


@register
class FedROD(Algorithm):
    name = "fedrod"

    def __init__(self, settings: Any, train: Any, units: Any) -> None:
        super().__init__(settings, train, units)
        self.head = head_names(units)
        self.body = len(units) - 1

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": clone(init_params), "personal": {k: init_params[k].clone() for k in self.head}}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        params = {**state["model"], **{PERSONAL + k: v for k, v in state["personal"].items()}}
        personal_names = [PERSONAL + k for k in self.head]
        # the personal head's optimiser is plain SGD at the lr (PFLlib clientrod.py, FedNH FedROD.py)
        fit = self.train_model(
            params,
            ctx,
            fedrod_loss(self.body, self.head),
            aux={"counts": ctx.label_counts},
            trainable=[*self.parameter_names, *personal_names],
            optimizer=ctx.train.optimizer(plain=personal_names),
        )
        model = {k: fit.params[k] for k in state["model"]}
        personal = {k: fit.params[PERSONAL + k] for k in self.head}
        return ({**state, "model": model, "personal": personal}, self.upload(model, ctx), {"train_loss": fit.loss})

    def local_model(self, state: State) -> Params:
        """The generic model it uploads (body and W_g), not the personalised one."""
        return state["model"]

    def eval_params(self, state: State) -> Params:
        """The personalised model: generic body, head W_g + W_p (both heads are linear)."""
        return {**state["model"], **{k: state["model"][k] + state["personal"][k] for k in self.head}}


FedROD.card = MethodCard(
    full_name="FedROD",
    paper=Paper(
        "On Bridging Generic and Personalized Federated Learning for Image Classification",
        "Chen & Chao",
        2022,
        "ICLR",
        "https://arxiv.org/abs/2107.00778",
    ),
    personalised=True,
    shares="The body and the generic head, with the training-set size; the server averages them as FedAvg.",
    keeps="The personal head.",
    scored="body + head W_g + W_p",
    scored_detail="The personal model: the body with head W_g + W_p. Global accuracy scores the generic model.",
    client_round="Overwrite the body and the generic head. Train on the balanced-softmax loss of the "
    "generic logits, plus cross-entropy of z_g (detached) + z_p on the personal head (detached "
    "features; plain SGD at the lr). Upload the body and the generic head.",
    references=(
        Reference("TsingZ0/PFLlib", "d832e76", ("clients/clientrod.py",)),
        Reference("Yutong-Dai/FedNH", "60c3161", ("src/flbase/strategies/FedROD.py",)),
    ),
    tests=(
        "tests/methods/test_fedrod.py::test_fedrod_matches_pfllibs_two_optimisers_per_batch_and_scores_the_summed_logits",
        "tests/methods/test_fedrod.py::test_fedrod_personal_head_plain_sgd_under_momentum_as_fednh",
        "tests/methods/test_fedrod.py::test_fedrods_adaptability_metrics_score_its_uploaded_generic_model",
    ),
    differences=(
        "The personal head steps by plain SGD at the lr, as in both references; the generic model by the "
        "run's optimiser.",
        "FedNH clips the generic gradients at norm 10; pflkit does not clip.",
        "PFLlib counts n_j over its `drop_last` loader, and FedNH puts 1e-12 for absent classes. pflkit "
        "counts all samples and gives absent classes −inf.",
        "FedNH's CIFAR runs make the personal head with a hypernetwork, and its scripts train the personal "
        "head after all generic epochs, on the final body (`FedROD_phead_separate`), where PFLlib and pflkit "
        "interleave them batch by batch. FedNH's port averages the generic models uniformly and scores the "
        "personalised model after local training.",
        "FedACD's local-model metrics score the uploaded generic model.",
    ),
)

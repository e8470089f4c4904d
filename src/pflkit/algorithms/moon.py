"""MOON (Li et al., CVPR 2021): model-contrastive federated learning.

Local objective: CE + μ ℓ_con with ℓ_con = −log(e^{sim(z, z_g)/τ} / (e^{sim(z, z_g)/τ} + e^{sim(z, z_p)/τ})),
z the body's output (every unit but the last) of the model being trained, z_g that of the received
global model and z_p that of the client's previous local model (both evaluation mode, no gradient),
sim the cosine similarity. Round 1 has no previous models: ℓ_con is 0 there (the authors' code).
Server: FedAvg.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, clone
from ..functional.training import Batch, LossFn, Net, batch_mean, classification_loss, cross_entropy
from .base import Algorithm, ClientContext, Payload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .registry import register


class MOONSettings(Settings):
    mu: float = Field(1.0, ge=0, description="μ, the weight of the model-contrastive loss (the authors' code: 1)")
    tau: float = Field(0.5, gt=0, description="τ, the temperature of the model-contrastive loss (MOON: 0.5)")


def contrastive(z: torch.Tensor, z_global: torch.Tensor, z_previous: torch.Tensor, tau: float) -> torch.Tensor:
    """Per sample ℓ_con: the cross-entropy of the positive pair (z, z_global) against the negative
    (z, z_previous), cosine similarities over the flattened representations divided by τ."""
    z, z_global, z_previous = z.flatten(1), z_global.flatten(1), z_previous.flatten(1)
    logits = torch.stack([F.cosine_similarity(z, z_global, dim=-1), F.cosine_similarity(z, z_previous, dim=-1)], -1)
    return -F.log_softmax(logits / tau, dim=-1)[..., 0]


def moon_loss(mu: float, tau: float, body: int) -> LossFn:
    """CE + μ ℓ_con; ``body``: the number of units whose output is the representation."""

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        z = net(params, batch.x, stop=body)
        logits = net(params, z, start=body)
        with torch.no_grad():
            z_global = net(aux["global"], batch.x, stop=body, train=False)
            z_previous = net(aux["previous"], batch.x, stop=body, train=False)
        return cross_entropy(logits, batch) + mu * batch_mean(contrastive(z, z_global, z_previous, tau), batch)

    return loss


@register
class MOON(Algorithm):
    name = "moon"
    settings_class = MOONSettings
    settings: MOONSettings

    body_use = "contrasts the representation the model's body computes before its head"

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": clone(init_params), "previous": clone(init_params)}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        loss: LossFn
        if ctx.round <= 1:  # no previous local models yet: the authors' contrastive loss is 0
            loss, aux = classification_loss, None
        else:
            loss = moon_loss(self.settings.mu, self.settings.tau, len(self.units) - 1)
            aux = {"global": {**state["model"], **payload["global"]}, "previous": state["previous"]}
        fit = self.train_model(state["model"], ctx, loss, aux=aux)
        new = {**state, "model": fit.params, "previous": clone(fit.params)}
        return new, self.upload(self.shared(fit.params), ctx), {"train_loss": fit.loss}


MOON.card = MethodCard(
    full_name="MOON",
    paper=Paper("Model-Contrastive Federated Learning", "Li et al.", 2021, "CVPR", "https://arxiv.org/abs/2103.16257"),
    personalised=False,
    shares="The whole model and its training-set size; the server averages them as FedAvg.",
    keeps="The client's previous local model (its model after its last training).",
    scored="the received global",
    client_round="Overwrite the local model with the received global. Train E epochs of SGD on CE + μ ℓ_con "
    "(μ = 1, τ = 0.5): ℓ_con contrasts the body's representation of each sample with the received global's "
    "(positive) and the previous local model's (negative) by cosine similarity. Keep the trained model as the "
    "previous model. Upload the model. In round 1 ℓ_con is 0.",
    references=(
        Reference(
            "QinbinLi/MOON",
            "8fcba3c",
            ("main.py (train_net_fedcon, the moon branch of the round loop)", "model.py (ModelFedCon)"),
        ),
        Reference(
            "TsingZ0/PFLlib",
            "f1e313a",
            ("system/flcore/clients/clientmoon.py", "system/flcore/servers/servermoon.py", "system/main.py"),
        ),
    ),
    tests=(
        "tests/methods/test_moon.py::test_moon_matches_the_authors_train_net_fedcon",
        "tests/methods/test_moon.py::test_moon_matches_pfllibs_client",
        "tests/methods/test_moon.py::test_moon_round_one_is_fedavg",
    ),
    differences=(
        "The authors compute z with a projection MLP (two linear layers, 256 outputs) on top of the body; pflkit's "
        "models have none, and z is the body's output, as in PFLlib.",
        "In round 1 the authors' contrastive loss has no negative and is 0. PFLlib contrasts with the client's "
        "initial model, which equals the global one then, so the gradient is the same and its loss is higher by "
        "μ log 2. pflkit follows the authors.",
        "A client that has never trained contrasts with its initial model: in pflkit the run's initial model, in the "
        "authors' code its own initialisation.",
        "The authors and pflkit run the global and previous models in evaluation mode; PFLlib runs them in "
        "training mode (different only with batch norm).",
        "The authors train with SGD momentum 0.9 and weight decay 1e-5; pflkit uses the run's optimiser settings.",
        "The authors keep a buffer of previous models (size 1 by default); pflkit keeps one.",
        "Batch norm: the authors load the whole averaged state, running statistics included, into the global "
        "model and into each client's start. With the default `bn_buffers = \"local\"` (PFLlib's), pflkit's "
        'download carries no statistics, so z_glob runs with the client\'s own; `bn_buffers = "global"` '
        "is the authors' form.",
    ),
    choices=(
        Choice("μ (the paper: 5 on CIFAR-10, 1 on CIFAR-100 and Tiny-ImageNet; PFLlib: 0)", "1", "moon.mu"),
        Choice("τ (PFLlib: 1)", "0.5", "moon.tau"),
    ),
    notes=(
        "`train_loss` includes μ ℓ_con.",
        "The previous model is client state: checkpoints carry it and a resumed run continues it.",
    ),
    ala_initialises="the local model; the positive representation stays the received global's",
)

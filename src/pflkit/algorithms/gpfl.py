"""GPFL (Zhang et al., ICCV 2023): a conditional valve splits the body's feature into a global and a
personalised feature, and a global category embedding aligns the global one.

Between the body and the head (``pflkit.models.between``) sits the conditional valve CoV: two
branches Linear(d, d) -> ReLU -> LayerNorm turn a conditional input c into γ(c) and β(c), and
CoV(h, c) = ReLU(h * (γ(c) + 1) + β(c)). The personalised feature f_p = CoV(h, p_i) feeds the
client's own head; the global feature f_g = CoV(h, g_i) is aligned to the global category
embedding (GCE) E [C, d]: in angle by CE of the cosine logits cos(f_g, E_c), in magnitude by
λ ||f_g - E_0[y]||_2 (the Frobenius norm over the batch, E_0 the received GCE, frozen). The client
trains body, head, CoV and GCE on CE(head(f_p)) + both alignments, with weight decay μ on CoV and
GCE; after training, g_i is the mean of its GCE's rows and p_i their mean weighted by its label
distribution (both zero before the client first trains). It uploads the body, CoV and GCE; the
server averages each (sample-weighted). The head, p_i and g_i stay on the client; the scored model
is head(CoV(h, p_i)).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, clone, torch_generator
from ..functional.training import Batch, LossFn, Net, cross_entropy
from ..models.between import Between, Head, register_between, without_between
from .base import ClientContext, Init, Payload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .registry import register
from .routed import RoutedMethod

BRANCHES = ("gamma", "beta")


class GPFLSettings(Settings):
    lamda: float = Field(
        0.01, ge=0, description="λ, the weight of the magnitude alignment ||f_g - E[y]|| (the authors' CNN: 0.01)"
    )
    mu: float = Field(0.1, ge=0, description="μ, the weight decay of CoV and GCE (the authors' CNN: 0.1)")


class ConditionalValve(Between):
    """GPFL's CoV and GCE (shared) and the client's conditional inputs (personal)."""

    kind = "gpfl"
    shared = frozenset(
        {f"{b}.{layer}.{p}" for b in BRANCHES for layer in ("linear", "norm") for p in ("weight", "bias")} | {"gce"}
    )

    def valve(self, params: Any, h: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """CoV(h, c) = ReLU(h * (γ(c) + 1) + β(c)) for features ``h`` [b, d] and input ``c`` [d], or
        ``c`` [m, d] for m inputs at once (one d x d product per branch), giving [m, b, d]."""
        n = self.name
        gamma, beta = (
            F.layer_norm(
                F.relu(F.linear(context, params[n(f"{b}.linear.weight")], params[n(f"{b}.linear.bias")])),
                context.shape[-1:],
                params[n(f"{b}.norm.weight")],
                params[n(f"{b}.norm.bias")],
            )
            for b in BRANCHES
        )
        if context.dim() == 2:
            gamma, beta = gamma[:, None], beta[:, None]
        return F.relu(h * (gamma + 1) + beta)

    def route(self, params: Any, h: torch.Tensor, head: Head) -> torch.Tensor:
        """The scored forward: the personal head on the personalised feature."""
        return head(params, self.valve(params, h, params[self.name("personal_input")]))


COV = register_between(ConditionalValve())


def gpfl_loss(body: int, lamda: float) -> LossFn:
    """CE(head(f_p)) + CE(cos(f_g, E)) + λ ||f_g - E_0[y]||_2 (μ is CoV's and GCE's weight decay in the
    optimiser, as the authors' SGD(weight_decay=μ))."""
    n = COV.name

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        h = net(params, batch.x, stop=body)
        # both conditional inputs through CoV at once
        personal, generic = COV.valve(params, h, torch.stack([params[n("personal_input")], params[n("generic_input")]]))
        value = cross_entropy(net(without_between(params), personal, start=body), batch)
        cosine = F.linear(F.normalize(generic), F.normalize(params[n("gce")]))
        value = value + cross_entropy(cosine, batch)
        gap = generic - aux["gce"][batch.y]
        if batch.mask is not None:
            gap = gap * batch.mask[:, None].to(gap.dtype)
        return value + lamda * gap.pow(2).sum().sqrt()

    return loss


@register
class GPFL(RoutedMethod):
    name = "gpfl"
    settings_class = GPFLSettings
    settings: GPFLSettings
    personal_part = "head"
    has_global_model = False  # the server never trains a head
    ala_targets = {}
    ala_refusal = (
        "GPFL's scored model reads the body's features through CoV, which ALA's objective on the plain "
        "model does not see"
    )

    route = COV

    def check_model(self, model: torch.nn.Module) -> None:
        if not getattr(model, "linear_head", False):
            raise ValueError(
                f"{self.name} feeds its head the conditional valve's features of the size a linear head reads, and "
                f"{type(model).__name__}'s head is no linear layer: choose a model with a linear head "
                "(digits_cnn, fedavg_cnn, resnet18, ...)"
            )

    def fresh_modules(self, like: torch.Tensor, seed: int) -> Params:
        """CoV's nn.Linear(d, d) default initialisation (U(±1/√d)), fresh layer norms, GCE ~ N(0, 1)
        as nn.Embedding(C, d)."""
        classes, d = like.shape
        g, bound = torch_generator(seed, "gpfl-modules"), d**-0.5
        uniform = lambda *shape: ((torch.rand(*shape, generator=g) * 2 - 1) * bound).to(like)  # noqa: E731
        out: Params = {}
        for b in BRANCHES:
            out[COV.name(f"{b}.linear.weight")] = uniform(d, d)
            out[COV.name(f"{b}.linear.bias")] = uniform(d)
            out[COV.name(f"{b}.norm.weight")] = torch.ones(d, dtype=like.dtype, device=like.device)
            out[COV.name(f"{b}.norm.bias")] = torch.zeros(d, dtype=like.dtype, device=like.device)
        out[COV.name("gce")] = torch.randn(classes, d, generator=g).to(like)
        return out

    def init_client(self, init_params: Params, client_id: int) -> State:
        weight = init_params[self.head[0]]
        placeholder = {k: torch.zeros_like(v) for k, v in self.fresh_modules(weight, 0).items()}
        inputs = {COV.name(k): torch.zeros_like(weight[0]) for k in ("personal_input", "generic_input")}
        return {"model": clone(init_params), "between": {**placeholder, **inputs}}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        glob = payload["global"]
        model = {**state["model"], **clone(without_between(glob))}
        return {**state, "model": model, "between": {**state["between"], **clone(COV.entries(glob))}}, {}

    def eval_params(self, state: State) -> Params:
        return {**state["model"], **state["between"]}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        cfg = self.settings
        shared = list(COV.shared_entries(state["between"]))
        fit = self.train_model(
            {**state["model"], **state["between"]},
            ctx,
            gpfl_loss(self.body, cfg.lamda),
            aux={"gce": payload["global"][COV.name("gce")]},
            trainable=[*self.parameter_names, *shared],
            # CoV and GCE: their own SGD with weight decay μ (the authors'), no momentum
            optimizer=replace(ctx.train.optimizer(plain=shared), decays=dict.fromkeys(shared, cfg.mu)),
        )
        model = {k: fit.params[k] for k in state["model"]}
        between = {k: fit.params[k] for k in state["between"]}
        gce = between[COV.name("gce")]
        counts = ctx.label_counts.to(gce)
        share = counts / counts.sum(-1, keepdim=True)
        between[COV.name("generic_input")] = gce.mean(-2)
        between[COV.name("personal_input")] = torch.einsum("...c,...cd->...d", share, gce)
        new = {**state, "model": model, "between": between}
        return new, self.upload({**self.shared(model), **COV.shared_entries(between)}, ctx), {"train_loss": fit.loss}


GPFL.card = MethodCard(
    full_name="GPFL",
    paper=Paper(
        "GPFL: Simultaneously Learning Global and Personalized Feature Information for Personalized Federated Learning",
        "Zhang et al.",
        2023,
        "ICCV",
        "https://arxiv.org/abs/2308.10279",
    ),
    personalised=True,
    shares="The body, the conditional valve CoV and the global category embedding GCE, with the training-set "
    "size; the server averages each (sample-weighted).",
    keeps="The head and the conditional inputs p_i and g_i.",
    scored="body, head(CoV(h, p_i))",
    scored_detail="No global accuracy: the server never trains a head.",
    client_round="Overwrite the body, CoV and GCE with the received ones. Train body, head, CoV and GCE E epochs "
    "of SGD on CE(head(CoV(h, p_i))) + CE(cos(CoV(h, g_i), GCE)) + λ ||CoV(h, g_i) - GCE_0[y]||_2 (λ = 0.01), "
    "with weight decay μ = 0.1 on CoV and GCE (GCE_0: the received embedding). Set g_i to the mean of the "
    "GCE's rows and p_i to their mean weighted by the client's label distribution. Upload body, CoV and GCE.",
    references=(
        Reference(
            "TsingZ0/GPFL",
            "ed7a7fe",
            (
                "system/flcore/clients/clientgp.py (train, set_GCE, test_metrics)",
                "system/flcore/servers/servergp.py (GCE, CoV, global_GCE, global_CoV, receive_models)",
                "system/run_me.sh (-lam 0.01 -mu 0.1 for the 4-layer CNN)",
            ),
        ),
    ),
    tests=(
        "tests/methods/test_gpfl.py::test_gpfl_client_is_the_authors_train",
        "tests/methods/test_gpfl.py::test_gpfl_server_averages_body_cov_and_gce_and_scores_the_personal_path",
    ),
    differences=(
        "The authors count the label distribution over the batches of a loader that drops the last incomplete "
        "batch; pflkit counts every training sample.",
        "The authors recompute every client's conditional inputs after each round from the GCE it holds; pflkit "
        "computes a client's after its own training, from its trained GCE (the same with every client in "
        "every round).",
        "The authors send the body, CoV and GCE to every client each round; pflkit sends them to the round's clients.",
        "The authors' loader does not shuffle; pflkit's reshuffles every epoch.",
        "A model whose head is no linear layer (squeezenet1_1) is refused.",
    ),
    choices=(
        Choice(
            "λ and μ",
            "0.01 and 0.1, the authors' script for the 4-layer CNN (their ResNet-18 and fastText runs: 0.0001 "
            "and 0; HAR-CNN: 0.01 and 1)",
            "`gpfl.lamda`, `gpfl.mu`",
        ),
    ),
    notes=(
        "`train_loss` includes both alignments; μ is a weight decay, as in the authors' optimisers, and not in it.",
        "CoV, GCE, p_i and g_i are entries between body and head (`between.gpfl.*`); checkpoints carry them.",
        "No `+ala`: the scored model reads the body's features through CoV, which ALA's objective on the "
        "plain model does not see.",
    ),
)

"""FedNH (Dai et al., AAAI 2023): a classifier of fixed-norm class prototypes, uniformly spread at
the start and smoothly filled with class semantics.

The head's weight rows are the prototypes (unit norm; its bias stays 0). Clients train the body
and the scale s on the scaled cosine logits s * <h/|h|, w_c> (the prototypes are frozen on the
clients), with the gradients' global norm clipped at 10, then upload their per-class means of
the normalised features with their class counts. The server averages the bodies and s (uniform
mean) and moves every prototype that a client saw:
w_c <- normalise(rho * w_c + (1 - rho) * normalise(sum_m n_mc mu_mc / sum_m n_mc)). The server
initialises the prototypes as orthonormal rows. Scored with the same cosine logits: the scored
model routes its features through ``between.cosine.scale`` (head(s * h/|h|)), so its test loss is
the authors' too.

Checked against the authors' code (Yutong-Dai/FedNH, commit 60c3161: ``FedNH.py``, ``FedUH.py``,
``models/CNN.py``): learnable s (1.0 for the CNN; their ResNet uses 20), trained with the body
under weight decay and clipping and averaged like any entry of the state dict; uniform server
mean; orthogonal prototype rows; rho = 0.9. Options give the earlier readings (a fixed s,
sample-weighted bodies, prototypes spread by optimisation). Not copied: their clients' prototype
estimate sees augmented images (pflkit's datasets are not augmented).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, clone, weighted_average
from ..functional.training import Batch, LossFn, Net, cross_entropy
from ..models import head_names
from ..models.between import Between, Head, register_between
from .base import Algorithm, ClientContext, Init, Payload, SentUpload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .registry import register


class FedNHSettings(Settings):
    smoothing: float = Field(
        0.9, ge=0, le=1, description="rho, the prototypes' moving average (the authors' code: 0.9)"
    )
    scale: float = Field(
        1.0,
        gt=0,
        description="s of the scaled cosine logits: its start value when learn_scale "
        "(the authors' code: 1.0 for the CNN, 20.0 for their ResNet-18), else fixed",
    )
    learn_scale: bool = Field(
        True, description="train s with the body and average it on the server (the authors' code); false: s stays fixed"
    )
    clip_norm: float = Field(
        10.0,
        ge=0,
        description="clip the local gradients' global L2 norm (the authors' code: 10 in every method); 0: no clipping",
    )
    body_weights: Literal["uniform", "samples"] = Field(
        "uniform", description="server mean of bodies and s: uniform (the authors' code) or sample-weighted (FedAvg)"
    )
    prototype_init: Literal["orthogonal", "spread"] = Field(
        "orthogonal",
        description="initial prototypes: orthonormal rows of orthogonal_(rand(C, d)) (the authors' "
        "code) or points pushed apart on the sphere by spread_steps of optimisation",
    )
    spread_steps: int = Field(500, ge=0, description="steps spreading the initial prototypes (prototype_init = spread)")


SCALE = "fednh.scale"  # the learnable scale s in the server and client states


class CosineFeatures(Between):
    """FedNH's scored classifier: the head on s * h/|h|. The head's rows are unit prototypes and its
    bias is 0, so the logits are s * cos(h, w_c), as in training. s is an entry of the scored model
    only (the client and server states keep it under ``fednh.scale``)."""

    kind = "cosine"
    shared = frozenset()

    def route(self, params: Any, h: torch.Tensor, head: Head) -> torch.Tensor:
        unit = F.normalize(h.flatten(1), dim=-1).reshape(h.shape)
        return head(params, params[self.name("scale")] * unit)


COSINE = register_between(CosineFeatures())


def spread_prototypes(num: int, dim: int, steps: int, seed: int = 0) -> torch.Tensor:
    """``num`` unit vectors in ``dim`` dimensions pushed apart (minimising a smooth maximum of their
    pairwise cosines), from a seeded Gaussian start. Server-side and once per run, on one tensor
    with no client data: ``torch.optim.SGD`` as in FedNH's code, not a client ``ctx.fit``."""
    g = torch.Generator().manual_seed(seed)
    points = F.normalize(torch.randn(num, dim, generator=g), dim=1).requires_grad_(True)
    opt = torch.optim.SGD([points], lr=0.1)
    mask = ~torch.eye(num, dtype=torch.bool)
    for _ in range(steps):
        unit = F.normalize(points, dim=1)
        cos = (unit @ unit.t())[mask]
        loss = torch.logsumexp(cos * 10.0, dim=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return F.normalize(points.detach(), dim=1)


def normalised_features(body: int) -> Any:
    def fn(net: Net, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.normalize(net(params, x, stop=body, train=False).flatten(1), dim=1)

    return fn


def orthogonal_prototypes(num: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Unit rows from ``orthogonal_(rand(num, dim))`` (orthonormal when num <= dim), seeded."""
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.nn.init.orthogonal_(torch.rand(num, dim, generator=g), generator=g), dim=1)


def cosine_loss(body: int, weight: str, scale: float | None = None) -> LossFn:
    """CE of s * <h/|h|, w_c/|w_c|>; s is ``params[SCALE]`` (trained) unless ``scale`` is given."""

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        h = F.normalize(net(params, batch.x, stop=body).flatten(1), dim=-1)
        s = params[SCALE] if scale is None else scale
        logits = s * (h @ F.normalize(params[weight], dim=-1).t())
        return cross_entropy(logits, batch)

    return loss


@register
class FedNH(Algorithm):
    name = "fednh"
    settings_class = FedNHSettings
    settings: FedNHSettings

    def __init__(self, settings: Any, train: Any, units: Any) -> None:
        super().__init__(settings, train, units)
        self.head = head_names(units)
        self.weight = self.head[0]
        self.body = len(units) - 1

    def init_server(self, init_params: Params) -> State:
        params = clone(init_params)
        weight = params[self.weight]
        if self.settings.prototype_init == "orthogonal":
            params[self.weight] = orthogonal_prototypes(*weight.shape).to(weight)
        else:
            num, dim = weight.shape
            params[self.weight] = spread_prototypes(num, dim, self.settings.spread_steps).to(weight)
        for name in self.head[1:]:
            params[name] = torch.zeros_like(params[name])
        return {"global": params, SCALE: self._initial_scale(weight)}

    def _initial_scale(self, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.settings.scale, dtype=like.dtype, device=like.device)

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        return {**super().downlink(server, client_id, round), SCALE: server[SCALE]}

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {**super().init_client(init_params, client_id), SCALE: self._initial_scale(init_params[self.weight])}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        state, metrics = super().receive(payload, state, ctx)
        return {**state, SCALE: payload[SCALE].clone()}, metrics

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        cfg = self.settings
        body = [n for n in self.parameter_names if n not in self.head]
        learn = cfg.learn_scale
        fit = self.train_model(
            {**state["model"], SCALE: state[SCALE]},
            ctx,
            cosine_loss(self.body, self.weight, None if learn else cfg.scale),
            trainable=body + ([SCALE] if learn else []),
            optimizer=ctx.train.optimizer(clip_norm=cfg.clip_norm or None),
        )
        model = {k: fit.params[k] for k in state["model"]}
        sums = ctx.class_sums(model, normalised_features(self.body))
        counts = ctx.label_counts
        upload = self.upload(
            model,
            ctx,
            class_means=F.normalize(sums, dim=-1),
            class_counts=counts.to(sums.dtype),
            scale=fit.params[SCALE].detach(),
        )
        return {**state, "model": model, SCALE: fit.params[SCALE].detach()}, upload, {"train_loss": fit.loss}

    def eval_params(self, state: State) -> Params:
        return self._scaled(state["model"], state[SCALE])

    def global_params(self, server: State) -> Params:
        return self._scaled(server["global"], server[SCALE])

    def _scaled(self, params: Params, scale: torch.Tensor) -> Params:
        """The model scored with the training logits s * <h/|h|, w_c> (a batched state holds one s
        per client, [K]; the engines slice it with the rest)."""
        if not self.settings.learn_scale:
            scale = torch.full_like(scale, self.settings.scale)
        return {**params, COSINE.name("scale"): scale}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        old = server["global"]
        weights = (
            [1.0] * len(uploads) if self.settings.body_weights == "uniform" else [u["num_samples"] for u in uploads]
        )
        merged = weighted_average([u["params"] for u in uploads], weights)
        total = sum(weights)
        # the ignores: uploads are SentUpload to mypy, scale/class_counts/class_means are FedNH's own keys
        scale = sum(w * u["scale"] for w, u in zip(weights, uploads)) / total  # type: ignore[typeddict-item]
        counts = torch.stack([u["class_counts"] for u in uploads])  # type: ignore[typeddict-item]
        means = torch.stack([u["class_means"] for u in uploads])  # type: ignore[typeddict-item]
        seen = counts.sum(0) > 0
        average = F.normalize((counts[..., None] * means).sum(0), dim=-1)
        rho = self.settings.smoothing
        moved = F.normalize(rho * old[self.weight] + (1 - rho) * average, dim=-1)
        prototypes = torch.where(seen[:, None], moved, old[self.weight])
        return {
            **server,
            SCALE: scale,
            "global": {**old, **merged, self.weight: prototypes, **{k: old[k] for k in self.head[1:]}},
        }


FedNH.card = MethodCard(
    full_name="FedNH",
    paper=Paper(
        "Tackling Data Heterogeneity in Federated Learning with Class Prototypes",
        "Dai et al.",
        2023,
        "AAAI",
        "https://arxiv.org/abs/2212.02758",
    ),
    personalised=False,
    shares="Its body, the scale s and its per-class means of the normalised features with their counts.",
    keeps="Nothing between rounds.",
    scored="the received global, on the cosine logits s·⟨h/‖h‖, w_c⟩",
    client_round="Overwrite the local model with the received global. Train the body and the scale s "
    "(from 1.0) on scaled cosine logits s·⟨h/‖h‖, w_c⟩ against frozen unit prototypes (orthonormal at the "
    "start); clip gradients at global norm 10. Upload per-class feature means. The server takes the "
    "uniform mean of bodies and s and moves each prototype: w_c ← normalise(ρ w_c + (1 − ρ) mean) (ρ = 0.9).",
    references=(
        Reference(
            "Yutong-Dai/FedNH",
            "60c3161",
            ("src/flbase/strategies/FedNH.py", "src/flbase/strategies/FedUH.py", "src/flbase/models/CNN.py"),
        ),
    ),
    tests=(
        "tests/methods/test_fednh.py::test_fednh_orthogonal_prototypes_learnable_scale_clipping_and_uniform_server_mean",
        "tests/methods/test_fednh.py::test_fednh_client_round_is_the_authors_training_under_momentum_weight_decay_and_clipping",
        "tests/methods/test_fednh.py::test_fednh_server_step_is_the_authors_aggregate_at_rho_other_than_one_half",
    ),
    differences=(
        "Their clients' prototype estimate sees augmented images.",
        "Their personalised accuracy scores the model after local training.",
    ),
    choices=(
        Choice(
            "scale, clipping, server mean, prototypes",
            "as the authors' code: a learnable s from 1.0 (their ResNet: 20), averaged; gradient clipping "
            "at norm 10; a uniform server mean; orthogonal prototypes; ρ = 0.9",
            "`fednh.scale`, `fednh.learn_scale = false` (a fixed s), `fednh.clip_norm`, "
            '`fednh.body_weights = "samples"`, `fednh.prototype_init = "spread"`, `fednh.smoothing`',
        ),
    ),
)

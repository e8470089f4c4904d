"""FedNH (Dai et al., AAAI 2023): a classifier of fixed-norm class prototypes, uniformly spread at
the start and smoothly filled with class semantics (spec §3.14).

The head's weight rows are the prototypes (unit norm; its bias stays 0). Clients train the body
only, on the scaled cosine logits s * <h/|h|, w_c> (the prototypes are frozen on the clients),
then upload their per-class means of the normalised features with their class counts. The
server averages the bodies (FedAvg) and moves every prototype that a client saw:
w_c <- normalise(rho * w_c + (1 - rho) * normalise(sum_m n_mc mu_mc / sum_m n_mc)). The server
initialises the prototypes spread over the sphere (minimising their largest pairwise cosine).
Evaluated with the linear head W h: its argmax equals the cosine classifier's.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, clone, weighted_average
from ..functional.training import Batch, LossFn, Net, cross_entropy
from ..models import head_names
from .base import Algorithm, ClientContext, Payload, SentUpload, Settings, State, Trained
from .registry import register


class FedNHSettings(Settings):
    smoothing: float = Field(0.9, ge=0, le=1, description="rho, the prototypes' moving average (spec §3.14 "
                             "[UNCERTAIN])")
    scale: float = Field(10.0, gt=0, description="s of the scaled cosine logits (fixed) [UNCERTAIN]: the FedNH code's "
                         "fixed choice 30 diverged on the digits at lr 0.05 with momentum 0.9")
    spread_steps: int = Field(500, ge=0, description="steps spreading the initial prototypes on the sphere")


def spread_prototypes(num: int, dim: int, steps: int, seed: int = 0) -> torch.Tensor:
    """``num`` unit vectors in ``dim`` dimensions pushed apart (minimising a smooth maximum of their
    pairwise cosines), from a seeded Gaussian start."""
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


def cosine_loss(body: int, weight: str, scale: float) -> LossFn:
    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        h = F.normalize(net(params, batch.x, stop=body).flatten(1), dim=-1)
        logits = scale * h @ F.normalize(params[weight], dim=-1).t()
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
        params[self.weight] = spread_prototypes(*weight.shape, self.settings.spread_steps).to(weight)
        for name in self.head[1:]:
            params[name] = torch.zeros_like(params[name])
        return {"global": params}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        body = [n for n in self.parameter_names if n not in self.head]
        fit = self.train_model(state["model"], ctx, cosine_loss(self.body, self.weight, self.settings.scale),
                               trainable=body)
        sums = ctx.class_sums(fit.params, normalised_features(self.body))
        counts = ctx.label_counts
        upload = self.upload(fit.params, ctx, class_means=F.normalize(sums, dim=-1),
                             class_counts=counts.to(sums.dtype))
        return {**state, "model": fit.params}, upload, {"train_loss": fit.loss}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        old = server["global"]
        merged = weighted_average([u["params"] for u in uploads], [u["num_samples"] for u in uploads])
        counts = torch.stack([u["class_counts"] for u in uploads])  # type: ignore[typeddict-item]
        means = torch.stack([u["class_means"] for u in uploads])  # type: ignore[typeddict-item]
        seen = counts.sum(0) > 0
        average = F.normalize((counts[..., None] * means).sum(0), dim=-1)
        rho = self.settings.smoothing
        moved = F.normalize(rho * old[self.weight] + (1 - rho) * average, dim=-1)
        prototypes = torch.where(seen[:, None], moved, old[self.weight])
        return {**server, "global": {**old, **merged, self.weight: prototypes,
                                     **{k: old[k] for k in self.head[1:]}}}

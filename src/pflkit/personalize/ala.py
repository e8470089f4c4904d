"""Adaptive Local Aggregation (ALA), the local-initialisation step of FedALA (AAAI 2023).

Instead of overwriting its local model with the downloaded global model, a client learns
element-wise weights W in [0, 1] on a random sample of its own training data (spec §1.2-1.6):

    Theta_hat = Theta_local + (Theta_global - Theta_local) * [1 (lower units); W (top p units)]
    W <- clip_[0,1](W - eta * dL/dTheta_hat * (Theta_global - Theta_local))     (paper Eq. 5/7)

Lower units are overwritten (the names the download carries); W persists per client
(initialised to ones); ALA is inactive while the downloaded model equals the local one (first
round); the first active round is the *start phase* (train W until the std of the last
``num_pre_loss`` epoch losses < ``threshold``, at most ``max_start_epochs`` epochs); later
rounds train W for one epoch.

Batch-norm running statistics are no ALA weights. ALA's forward passes run in training mode,
like the reference (which trains a deep copy of the local model), on throwaway copies of the
statistics: the client's stored buffers are not changed by ALA.

``WithALA`` wraps any algorithm whose local initialisation overwrites a local copy with a
downloaded model (FedALA = FedAvg + ALA; "X + ALA" of FedALA Table 4).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch.nn import functional as F

from ..algorithms.base import (Algorithm, ClientContext, ClientSummary, Payload, Settings, State,
                               TrainSettings, Upload)
from ..functional import Params, check_finite, equal, forward
from ..models import Units, buffer_names

log = logging.getLogger(__name__)


class ALASettings(Settings):
    """The ``[fedala]`` section: ALA hyperparameters, used by ``fedala`` and every ``X+ala``."""

    eta: float = Field(1.0, gt=0, description="learning rate of the ALA weights (App. G: 1.0)")
    sample_fraction: float = Field(0.8, gt=0, le=1, description="s, share of local training data "
                                   "sampled for ALA each round (App. G: s=80%)")
    p: int = Field(1, ge=1, description="number of top units (layers/blocks) that ALA blends (App. G: 1)")
    threshold: float = Field(0.01, gt=0, description="start phase stops when the std of the last "
                             "num_pre_loss epoch losses is below this (paper README: 0.01)")
    num_pre_loss: int = Field(10, ge=2, description="window of the start-phase convergence test")
    max_start_epochs: int = Field(200, ge=1, description="hard cap on start-phase epochs (ours; spec §1.6)")
    sampling: Literal["random", "contiguous"] = Field(
        "random", description="s% sample: uniform subset (paper) or the reference code's contiguous slice")
    cache_features: bool = Field(
        True, description="compute the frozen lower units' output on the sample once per round and "
        "iterate only the top p units (exact for models whose lower units are deterministic)")
    closed_form_head: bool = Field(
        True, description="with p=1 and a linear head, use the closed-form cross-entropy gradient "
        "instead of autograd (same maths, less per-step overhead)")


def blend(local: Params, received: Params, weights: Params) -> Params:
    """Theta_local + (Theta_received - Theta_local) * W for the names in ``weights`` (Eq. 3)."""
    return {k: torch.addcmul(local[k], received[k] - local[k], w) for k, w in weights.items()}


def weight_gradient(blended_grad: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dL/dW = dL/dTheta_hat * (Theta_received - Theta_local), with delta = received - local (Eq. 7)."""
    return blended_grad * delta


def weight_step(weights: torch.Tensor, blended_grad: torch.Tensor, delta: torch.Tensor,
                eta: float) -> torch.Tensor:
    """One ALA update: W <- clip_[0,1](W - eta * dL/dW) (paper Eq. 5), dL/dW = grad * delta."""
    return torch.addcmul(weights, blended_grad, delta, value=-eta).clamp_(0.0, 1.0)


def linear_head_step(h: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     with_loss: bool = True) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of ``h @ weight.T + bias`` and its gradients, in closed form.

    ``target`` is one-hot(labels) / batch size. dL/dlogits = softmax / B - target, so
    dL/dweight = (dL/dlogits)^T h and dL/dbias = its column sum: autograd's result (to float
    rounding) with a few tensor ops, since on CPU the per-op overhead dominates these steps.
    """
    logits = torch.addmm(bias, h, weight.t())
    loss = -(torch.log_softmax(logits, dim=1) * target).sum() if with_loss else None
    g = torch.softmax(logits, dim=1).div_(len(h)).sub_(target)
    return loss, g.t() @ h, g.sum(0)


class AdaptiveLocalAggregation:
    """The ALA step for one model layout; stateless, all client state is passed in and out."""

    def __init__(self, settings: ALASettings, units: Units, train: TrainSettings) -> None:
        if settings.p > len(units):
            raise ValueError(f"fedala.p={settings.p} exceeds this model's {len(units)} units "
                             f"({', '.join(u for u, _ in units)})")
        self.settings = settings
        self.units = units
        self.train = train

    def init_state(self, downloaded: Params) -> State:
        """Weights W initialised to ones over the top p of the downloaded units (spec §1.7)."""
        _, top = self.top_units(downloaded)
        return {"weights": {k: torch.ones_like(downloaded[k]) for k in top}, "started": False}

    def top_units(self, received: Params | list[str]) -> tuple[int, list[str]]:
        """(index of the lowest top unit, parameter names of the top p units among the units
        the payload carries); FedRep's payload carries the body only."""
        carried = [i for i, (_, ms) in enumerate(self.units) if all(m in received for m in ms)]
        if not carried:
            raise ValueError("ALA received no complete unit of the model")
        chosen = carried[-min(self.settings.p, len(carried)):]
        return chosen[0], [n for i in chosen for n in self.units[i][1]]

    def top_names(self, received: Params | list[str]) -> list[str]:
        return self.top_units(received)[1]

    def closed_form(self, model: torch.nn.Module, prefix: int, top: list[str]) -> bool:
        """Whether the cached features feed only a linear head (p = 1): closed-form gradients."""
        return (self.settings.closed_form_head and prefix == len(self.units) - 1
                and getattr(model, "linear_head", False) and top == list(self.units[-1][1]) and len(top) == 2)

    def prefix_stop(self, model: torch.nn.Module, lowest_top: int) -> int:
        """How many lower units can be computed once per round (0: no feature cache)."""
        if not self.settings.cache_features or not getattr(model, "prefix_is_deterministic", False):
            return 0
        # Only units below the lowest top unit, and only if none of them is blended.
        return lowest_top

    def sample(self, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The s% sample D_i^{s,t}: at least one sample, drawn from the client's ALA stream."""
        x, y = ctx.data.train_x, ctx.data.train_y
        idx = self.sample_indices(len(y), ctx.generator("ala")).to(x.device)
        return x[idx], y[idx]

    def sample_indices(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """Positions (in the client's training data) of the s% sample: at least one sample."""
        k = max(1, int(self.settings.sample_fraction * n))
        if self.settings.sampling == "random":
            return torch.randperm(n, generator=generator)[:k]
        start = int(torch.randint(0, n - k + 1, (1,), generator=generator))
        return torch.arange(start, start + k)

    def converged(self, losses: list[float], client_id: int) -> bool:
        """The start-phase stopping rule (spec §1.6), with the hard cap."""
        cfg = self.settings
        if len(losses) > cfg.num_pre_loss and np.std(losses[-cfg.num_pre_loss:]) < cfg.threshold:
            return True
        if len(losses) >= cfg.max_start_epochs:
            log.warning("ALA start phase of client %d stopped at the cap of %d epochs (loss std %.4g "
                        ">= threshold %.4g)", client_id, cfg.max_start_epochs,
                        float(np.std(losses[-cfg.num_pre_loss:])), cfg.threshold)
            return True
        return False

    def __call__(self, received: Params, local: Params, state: State,
                 ctx: ClientContext) -> tuple[Params, State, dict[str, Any]]:
        """Return the initialised local model, the new ALA state and diagnostics."""
        if getattr(ctx, "batched", False):
            from .ala_batched import batched_ala
            return batched_ala(self, received, local, state, ctx)  # type: ignore[arg-type]
        if equal(received, local):
            return {**local, **received}, state, {"ala_epochs": 0}
        lowest_top, top = self.top_units(received)
        fixed = {**local, **{k: v for k, v in received.items() if k not in top}}
        # training-mode forwards update running statistics in place: give them throwaway copies
        scratch = {**fixed, **{k: fixed[k].detach().clone() for k in buffer_names(ctx.model) if k in fixed}}
        local_top = {k: local[k].detach() for k in top}
        delta = {k: received[k].detach() - local_top[k] for k in top}
        weights = {k: w.clone() for k, w in state["weights"].items()}
        start_phase = not state["started"]
        x, y = self.sample(ctx)
        prefix = self.prefix_stop(ctx.model, lowest_top)
        if prefix:
            with torch.no_grad():  # lower units are frozen: their output is constant this round
                x = forward(ctx.model, scratch, x, stop=prefix, train=True)
        b = self.train.batch_size
        batches = [(x[i:i + b], y[i:i + b]) for i in range(0, len(y), b)]
        losses: list[float] = []
        eta = self.settings.eta
        closed_form = self.closed_form(ctx.model, prefix, top)
        if closed_form:
            targets = [F.one_hot(yb, len(local_top[top[1]])).to(xb.dtype).div_(len(yb)) for xb, yb in batches]
        while True:
            for j, (xb, yb) in enumerate(batches):
                if closed_form:
                    with torch.no_grad():
                        blended = [torch.addcmul(local_top[k], delta[k], weights[k]) for k in top]
                        loss, *grads = linear_head_step(xb, targets[j], *blended, with_loss=j == len(batches) - 1)
                else:
                    blended = {k: torch.addcmul(local_top[k], delta[k], weights[k]).requires_grad_(True)
                               for k in top}
                    loss = F.cross_entropy(forward(ctx.model, {**scratch, **blended}, xb, start=prefix, train=True),
                                           yb)
                    grads = torch.autograd.grad(loss, [blended[k] for k in top])
                with torch.no_grad():
                    for k, g in zip(top, grads):
                        weights[k] = weight_step(weights[k], g, delta[k], eta)
            last = loss.detach()
            check_finite(last, ctx.where("ALA weight learning"))
            losses.append(float(last))
            if not start_phase or self.converged(losses, ctx.client_id):
                break
        with torch.no_grad():
            initialised = {**fixed, **blend(local_top, {k: received[k] for k in top}, weights)}
        info = {"ala_epochs": len(losses), "ala_loss": losses[-1]}
        return {k: initialised[k] for k in local}, {"weights": weights, "started": True}, info


class WithALA(Algorithm):
    """``base`` with its local initialisation replaced by ALA on its configured target."""

    batched_init = True  # the parallel engine runs receive (ALA) for all clients of a round at once

    def __init__(self, base: Algorithm, ala: AdaptiveLocalAggregation, display_name: str) -> None:
        super().__init__(base.settings, base.train, base.units)
        self.base = base
        self.ala = ala
        self.name = display_name  # type: ignore[misc]
        target = base.ala_target
        if target not in base.ala_targets:
            raise ValueError(f"{base.name} offers ALA targets {sorted(base.ala_targets)}, not {target!r}")
        self.payload_key, self.state_key = base.ala_targets[target]
        self.supports_batching = base.supports_batching  # type: ignore[misc]

    def init_server(self, init_params: Params) -> State:
        return self.base.init_server(init_params)

    def prepare(self, server: State, clients: list[ClientSummary]) -> State:
        return self.base.prepare(server, clients)

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        return self.base.downlink(server, client_id, round)

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        return self.base.aggregate(server, uploads, round)

    def global_params(self, server: State) -> Params:
        return self.base.global_params(server)

    def init_client(self, init_params: Params, client_id: int) -> State:
        downloaded = {k: init_params[k] for k in self.base.downloaded_names(list(init_params))}
        return {**self.base.init_client(init_params, client_id), "ala": self.ala.init_state(downloaded)}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        old_local = state[self.state_key]
        new_state = self.base.receive(payload, state, ctx)
        initialised, ala_state, info = self.ala(payload[self.payload_key], old_local, state["ala"], ctx)
        ctx.info.update(info)
        return {**new_state, self.state_key: initialised, "ala": ala_state}

    def after_receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        return self.base.after_receive(payload, state, ctx)

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        return self.base.local_train(payload, state, ctx)

    def eval_params(self, state: State) -> Params:
        return self.base.eval_params(state)

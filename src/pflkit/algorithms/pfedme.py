"""pFedMe (T Dinh et al., NeurIPS 2020): personalisation through Moreau envelopes (spec §2.6).

The local model w is reset to the received global each round. For every mini-batch B of the E
local epochs:

    K times:  theta <- theta - eta_p * (grad f(theta; B) + lam * (theta - w) [+ l2 * theta])
    then:     w     <- w - lr * lam * (w - theta)

theta (the personalised model) starts the round at the received global model and is warm-started
across mini-batches. The client uploads w; the server mixes
Theta^t = (1 - beta) Theta^{t-1} + beta * sum_i k_i w_i (beta = 1: FedAvg).

Evaluated model: the last computed personalised theta (Theta^0 before the first participation).
With ``+ala`` ALA initialises the local model w ("model"); theta then starts at the received
global (``theta_init="received"``, spec wording) or at the ALA-initialised w (``"local"``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, check_finite, clone, weighted_average
from .base import Algorithm, ClientContext, Payload, Settings, State, Upload
from .registry import register


class PFedMeSettings(Settings):
    personal_lr: float = Field(0.01, gt=0, description="eta_p, step size of the K inner steps on theta "
                               "(FedALA App. G: 0.01)")
    lam: float = Field(15.0, ge=0, description="lambda, Moreau-envelope regularisation (App. G: 15)")
    inner_steps: int = Field(5, ge=1, description="K, inner steps on theta per mini-batch (App. G: 5)")
    beta: float = Field(1.0, gt=0, le=1, description="server mixing (1 - beta) old + beta avg (App. G: 1.0)")
    l2: float = Field(0.0, ge=0, description="extra l2 * theta in the inner step; the reference uses 0.001 "
                      "(spec §2.6 [REF-CODE] option, default off)")
    # spec §2.6: the paper averages uniformly over sampled clients, PFLlib weights by samples
    server_weights: Literal["samples", "uniform"] = Field(
        "samples", description="server average weighted by sample counts (PFLlib, library rule §0.2) or "
        "uniform over the sampled clients (paper) (spec §2.6)")
    # spec §1.8/§2.6: with +ala only w is ALA-initialised; where theta starts is our choice
    theta_init: Literal["received", "local"] = Field(
        "received", description="theta's start each round: the received global (spec §2.6) or the "
        "(ALA-)initialised local w; identical without +ala")


@register
class PFedMe(Algorithm):
    name = "pfedme"
    settings_class = PFedMeSettings
    settings: PFedMeSettings
    supports_batching = False

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": clone(init_params), "personal": clone(init_params)}

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        weights = ([u["num_samples"] for u in uploads] if self.settings.server_weights == "samples"
                   else [1.0] * len(uploads))
        avg = weighted_average([u["params"] for u in uploads], weights)
        beta, old = self.settings.beta, server["global"]
        trainable = {n for _, ms in self.units for n in ms}
        if beta != 1.0:  # buffers (batch-norm statistics) take the plain average (spec §0.2)
            avg = {k: (old[k] * (1.0 - beta) + v * beta if k in trainable else v) for k, v in avg.items()}
        return {**server, "global": {**old, **avg}}

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        cfg = self.settings
        names = [n for _, ms in self.units for n in ms]
        w = {k: v.detach().clone() for k, v in state["model"].items()}
        start = payload["global"] if cfg.theta_init == "received" else state["model"]
        theta = {**w, **{k: start[k].detach().clone() for k in names}}
        lr, eta, lam, l2 = self.train.lr, cfg.personal_lr, cfg.lam, cfg.l2
        device = next(iter(w.values())).device
        loss_sum = torch.zeros((), device=device)  # every inner loss, for the NaN check
        last_sum = torch.zeros((), device=device)  # loss of the last inner step per batch (reported)
        batches = 0
        for x, y in ctx.batches("train", self.train.local_epochs):
            for _ in range(cfg.inner_steps):
                leaves = [theta[k].detach().requires_grad_(True) for k in names]
                loss = F.cross_entropy(ctx.logits({**theta, **dict(zip(names, leaves))}, x), y)
                grads = torch.autograd.grad(loss, leaves)
                with torch.no_grad():
                    for k, g in zip(names, grads):
                        step = g + lam * (theta[k] - w[k])
                        if l2:
                            step = step + l2 * theta[k]
                        theta[k] = theta[k] - eta * step
                loss_sum += loss.detach()
            last_sum += loss.detach()
            batches += 1
            with torch.no_grad():
                for k in names:
                    w[k] = w[k] - lr * lam * (w[k] - theta[k])
        check_finite(loss_sum, ctx.where("local training (personalised inner steps)"))
        return ({**state, "model": w, "personal": theta}, self.upload(w, ctx),
                {"train_loss": float(last_sum) / max(batches, 1)})

    def eval_params(self, state: State) -> Params:
        return state["personal"]

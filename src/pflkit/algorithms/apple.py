"""APPLE (Luo & Wu, IJCAI 2022): personalised models as learned mixtures of all clients' core
models (spec §2.11).

Client i keeps its core model w_i^c and a directed-relationship vector p_i (initialised to the
clients' data shares p^0). Each round it downloads every other client's core and, on every
mini-batch, minimises CE(w_i^p) + lambda(r) mu ||p_i - p^0||^2 with w_i^p = sum_j p_ij w_j^c,
updating only its own core (lr ``core_lr``, default the local lr) and p_i (lr ``dr_lr``); the
other cores are frozen.
lambda(r) anneals to 0 at round L*R (cos or exp schedule). It uploads its core; p_i stays local.
Every client must take part in every round. Evaluated model: w_i^p. No ALA: several models
are downloaded.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, check_finite
from .base import Algorithm, ClientContext, ClientSummary, Payload, Settings, State, Upload
from .registry import register


class AppleSettings(Settings):
    dr_lr: float = Field(0.01, gt=0, description="eta_2, learning rate of the DR vector (App. G: 0.01)")
    mu: float = Field(0.1, ge=0, description="mu, weight of the proximal term on p (App. G: 0.1)")
    L: float = Field(0.2, ge=0, le=1, description="share of the rounds during which lambda(r) > 0 (App. G: 0.2)")
    scheduler: Literal["cos", "exp"] = Field("cos", description="lambda(r) schedule (App. G: cos)")
    core_lr: float | None = Field(None, gt=0, description="eta_1, core learning rate; None = the local lr. "
                                  "PFLlib's lr x N diverges with the true gradient of p (spec §2.11 [UNCERTAIN]; "
                                  "docs/algorithms.md)")


def loss_scale(r: int, total_rounds: int, L: float, scheduler: str) -> float:
    """lambda(r): 1/2 (1 + cos(pi r / (L R))) or 0.001^(r / (L R)) for r < L R, else 0."""
    horizon = L * total_rounds
    if r >= horizon:
        return 0.0
    if scheduler == "cos":
        return 0.5 * (1.0 + math.cos(math.pi * r / horizon))
    return 0.001 ** (r / horizon)


def mixture(p: torch.Tensor, cores: dict[str, torch.Tensor], own: Params, own_index: int) -> Params:
    """w^p = sum_j p_j w_j^c, where ``cores`` are stacked [N, ...] with a zero slot for the own core."""
    return {k: torch.tensordot(p, cores[k], dims=1) + p[own_index] * own[k] for k in own}


@register
class Apple(Algorithm):
    name = "apple"
    settings_class = AppleSettings
    settings: AppleSettings
    ala_targets = {}
    supports_batching = False
    requires_full_participation = True

    def prepare(self, server: State, clients: list[ClientSummary]) -> State:
        sizes = torch.zeros(max(c.client_id for c in clients) + 1)
        for c in clients:
            sizes[c.client_id] = c.num_train
        device = next(iter(server["global"].values())).device
        return {**server, "models": {c.client_id: server["global"] for c in clients},
                "p0": (sizes / sizes.sum()).to(device)}

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        return {"cores": [server["models"][j] for j in range(len(server["p0"]))], "p0": server["p0"]}

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": dict(init_params), "p": torch.empty(0), "personal": dict(init_params)}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        p = state["p"] if state["p"].numel() else payload["p0"].clone()
        return {**state, "p": p}

    def after_receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        cores = self._stacked_others(payload, ctx.client_id)
        with torch.no_grad():
            personal = mixture(state["p"].to(cores[next(iter(cores))].dtype), cores, state["model"], ctx.client_id)
        return {**state, "personal": personal}

    def eval_params(self, state: State) -> Params:
        return state["personal"]

    @staticmethod
    def _stacked_others(payload: Payload, client_id: int) -> dict[str, torch.Tensor]:
        cores = payload["cores"]
        stacked = {k: torch.stack([c[k] for c in cores]) for k in cores[0]}
        for v in stacked.values():
            v[client_id].zero_()
        return stacked

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        return self.keep_latest_models(server, uploads)

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        cfg, i = self.settings, ctx.client_id
        cores = self._stacked_others(payload, i)
        p0 = payload["p0"]
        core_lr = cfg.core_lr if cfg.core_lr is not None else self.train.lr
        scale = loss_scale(ctx.round, self.train.rounds, cfg.L, cfg.scheduler) * cfg.mu
        names = [n for _, members in self.units for n in members]
        own = {k: v.detach().clone() for k, v in state["model"].items()}
        for n in names:
            own[n].requires_grad_(True)
        p = state["p"].detach().clone().requires_grad_(True)
        leaves = [own[n] for n in names]
        loss_sum, count = torch.zeros((), device=p.device), 0
        for x, y in ctx.batches("train", self.train.local_epochs):
            ce = F.cross_entropy(ctx.logits(mixture(p, cores, own, i), x), y)
            loss = ce + scale * torch.sum((p - p0) ** 2) if scale else ce
            *core_grads, p_grad = torch.autograd.grad(loss, leaves + [p])
            with torch.no_grad():
                torch._foreach_add_(leaves, core_grads, alpha=-core_lr)
                p.sub_(p_grad, alpha=cfg.dr_lr)
            loss_sum += ce.detach()
            count += 1
        check_finite(loss_sum, ctx.where("local training"))
        core = {k: v.detach() for k, v in own.items()}
        new_state = {**state, "model": core, "p": p.detach()}
        return new_state, self.upload(core, ctx), {"train_loss": float(loss_sum) / max(count, 1)}

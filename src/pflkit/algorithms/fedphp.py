"""FedPHP (Li et al., ECML-PKDD 2021): an inherited private model (HPM) per client (spec §2.9).

Round t: w <- Theta^{t-1}; E epochs of SGD on (1 - lam) * CE(w) + lam * KT(w, v), with the HPM v
frozen; KT is (default, PFLlib) the biased MMD between the body features (all units but the
last) of w and v on the batch, with the RBF kernel sum_s exp(-||a - b||^2 / (2 s)),
s in {10, 15, 20, 50}: MMD = mean(K_xx + K_yy - 2 K_xy); option ``kt="kd"``: logit distillation
T^2 * KL(softmax(v / T) || softmax(w / T)). After training, mu_t = mu * t / T (T = the run's
total rounds, ``train.rounds``) and v <- mu_t v + (1 - mu_t) w. Upload w; server FedAvg.

Evaluated model: the locally trained w of the client's last participation (PFLlib evaluates
FedPHP after training; here evaluation follows local_init, so the trained w is kept in
state["trained"], Theta^0 before the first participation); option ``eval_hpm`` scores v.
With ``+ala`` ALA initialises the received model w ("model").
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, check_finite, clone
from .base import Algorithm, ClientContext, Payload, Settings, State, Upload
from .registry import register


class FedPHPSettings(Settings):
    mu: float = Field(0.9, ge=0, le=1, description="HPM momentum; mu_t = mu * t / T (FedALA App. G: 0.9)")
    lam: float = Field(0.01, ge=0, le=1, description="weight of the knowledge-transfer loss (App. G: 0.01)")
    # spec §2.9: the paper studies several KT types; the reference (PFLlib) uses MMD on features
    kt: Literal["mmd", "kd"] = Field("mmd", description="knowledge transfer from the HPM: MMD on body "
                                     "features (PFLlib [REF-CODE]) or logit KD (spec §2.9 option)")
    bandwidths: list[float] = Field([10.0, 15.0, 20.0, 50.0], min_length=1,
                                    description="RBF kernel bandwidths s of the MMD (spec §2.9 [REF-CODE])")
    temperature: float = Field(1.0, gt=0, description="KD temperature (kt='kd'; spec §2.9 [UNCERTAIN])")
    eval_hpm: bool = Field(False, description="score the HPM v instead of the trained w (spec §2.9 option)")


def mmd_rbf(x: torch.Tensor, y: torch.Tensor, bandwidths: Sequence[float]) -> torch.Tensor:
    """Biased MMD^2 estimate mean(K_xx + K_yy - 2 K_xy), K = sum_s exp(-||a - b||^2 / (2 s))."""
    x, y = x.flatten(1), y.flatten(1)
    sx, sy = (x * x).sum(1), (y * y).sum(1)
    dxx = (sx[:, None] + sx[None, :] - 2 * x @ x.t()).clamp_min(0)
    dyy = (sy[:, None] + sy[None, :] - 2 * y @ y.t()).clamp_min(0)
    dxy = (sx[:, None] + sy[None, :] - 2 * x @ y.t()).clamp_min(0)
    total = torch.zeros_like(dxy)
    for s in bandwidths:
        total = total + torch.exp(-dxx / (2 * s)) + torch.exp(-dyy / (2 * s)) - 2 * torch.exp(-dxy / (2 * s))
    return total.mean()


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), averaged over the batch."""
    t = temperature
    return F.kl_div(F.log_softmax(student / t, dim=1), F.softmax(teacher / t, dim=1),
                    reduction="batchmean") * t * t


def hpm_coefficient(mu: float, round: int, rounds: int) -> float:
    """mu_t = mu * t / T (t capped at T)."""
    return mu * min(round, rounds) / rounds


@register
class FedPHP(Algorithm):
    name = "fedphp"
    settings_class = FedPHPSettings
    settings: FedPHPSettings
    supports_batching = False

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": clone(init_params), "hpm": clone(init_params), "trained": clone(init_params)}

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        cfg = self.settings
        names = [n for _, ms in self.units for n in ms]
        body = len(self.units) - 1
        w = {k: v.detach().clone() for k, v in state["model"].items()}
        hpm = {k: v.detach().clone() for k, v in state["hpm"].items()}  # frozen teacher (own buffers)
        device = next(iter(w.values())).device
        loss_sum = torch.zeros((), device=device)
        ce_sum = torch.zeros((), device=device)
        kt_sum = torch.zeros((), device=device)
        steps = 0
        for x, y in ctx.batches("train", self.train.local_epochs):
            leaves = [w[k].detach().requires_grad_(True) for k in names]
            params = {**w, **dict(zip(names, leaves))}
            features = ctx.logits(params, x, stop=body)
            logits = ctx.logits(params, features, start=body)
            ce = F.cross_entropy(logits, y)
            with torch.no_grad():
                teacher = ctx.logits(hpm, x, stop=body if cfg.kt == "mmd" else None)
            kt = (mmd_rbf(features, teacher, cfg.bandwidths) if cfg.kt == "mmd"
                  else kd_loss(logits, teacher, cfg.temperature))
            loss = (1 - cfg.lam) * ce + cfg.lam * kt
            grads = torch.autograd.grad(loss, leaves)
            with torch.no_grad():
                for k, g in zip(names, grads):
                    w[k] = w[k] - self.train.lr * g
            loss_sum += loss.detach()
            ce_sum += ce.detach()
            kt_sum += kt.detach()
            steps += 1
        check_finite(loss_sum, ctx.where("local training (CE + knowledge transfer)"))
        mu_t = hpm_coefficient(cfg.mu, ctx.round, self.train.rounds)
        with torch.no_grad():
            new_hpm = {k: state["hpm"][k] * mu_t + w[k] * (1 - mu_t) for k in state["hpm"]}
        metrics = {"train_loss": float(loss_sum) / max(steps, 1), "ce_loss": float(ce_sum) / max(steps, 1),
                   "kt_loss": float(kt_sum) / max(steps, 1), "hpm_mu": mu_t}
        return {**state, "model": w, "hpm": new_hpm, "trained": w}, self.upload(w, ctx), metrics

    def eval_params(self, state: State) -> Params:
        return state["hpm"] if self.settings.eval_hpm else state["trained"]

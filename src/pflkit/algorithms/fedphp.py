"""FedPHP (Li et al., ECML-PKDD 2021): an inherited private model (HPM) per client.

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

``variant = "pfllib2022"`` is PFLlib's FedPHP at the time of the FedALA paper (TsingZ0/PFLlib
f1e313a, ``clientphp.py``), whose numbers FedALA's tables report: no HPM; on receiving, the local
model becomes w <- (1 - mu_R) Theta + mu_R w_old (mu_R = mu * R / T, R = t - 1 counting from 0 as
PFLlib's rounds do), it is scored then, and trained on (1 - lam) CE(w) + lam MMD(features of w,
features of the received global model Theta).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, clone
from ..functional.training import Batch, LossFn, Net, cross_entropy
from .base import Algorithm, ClientContext, Init, Payload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .registry import register


class FedPHPSettings(Settings):
    mu: float = Field(0.9, ge=0, le=1, description="HPM momentum; mu_t = mu * t / T (FedALA App. G: 0.9)")
    lam: float = Field(0.01, ge=0, le=1, description="weight of the knowledge-transfer loss (App. G: 0.01)")
    # the FedPHP paper studies several KT types; the reference (PFLlib's clientphp.py) uses MMD on features
    kt: Literal["mmd", "kd"] = Field(
        "mmd",
        description="knowledge transfer from the HPM: MMD on body features (PFLlib's) or logit KD",
    )
    bandwidths: list[float] = Field(
        [10.0, 15.0, 20.0, 50.0], min_length=1, description="RBF kernel bandwidths s of the MMD (PFLlib's)"
    )
    temperature: float = Field(1.0, gt=0, description="KD temperature (kt='kd')")
    eval_hpm: bool = Field(False, description="score the HPM v instead of the trained w")
    variant: Literal["hpm", "pfllib2022"] = Field(
        "hpm",
        description="hpm: the paper's inherited private model; pfllib2022: PFLlib's FedPHP of "
        "FedALA's time (blend the global into the old local model on receiving, MMD toward the global model)",
    )


def mmd_rbf(
    x: torch.Tensor, y: torch.Tensor, bandwidths: Sequence[float], mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Biased MMD^2 estimate mean(K_xx + K_yy - 2 K_xy), K = sum_s exp(-||a - b||^2 / (2 s)); with
    ``mask`` (padded batches) the means run over the real samples only."""
    x, y = x.flatten(1), y.flatten(1)
    sx, sy = (x * x).sum(1), (y * y).sum(1)
    dxx = (sx[:, None] + sx[None, :] - 2 * x @ x.t()).clamp_min(0)
    dyy = (sy[:, None] + sy[None, :] - 2 * y @ y.t()).clamp_min(0)
    dxy = (sx[:, None] + sy[None, :] - 2 * x @ y.t()).clamp_min(0)
    total = torch.zeros_like(dxy)
    for s in bandwidths:
        total = total + torch.exp(-dxx / (2 * s)) + torch.exp(-dyy / (2 * s)) - 2 * torch.exp(-dxy / (2 * s))
    if mask is None:
        return total.mean()
    pairs = mask[:, None] * mask[None, :]
    return (total * pairs).sum() / pairs.sum()


def kd_loss(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), averaged over the (real) samples."""
    t = temperature
    if mask is None:
        return F.kl_div(F.log_softmax(student / t, dim=1), F.softmax(teacher / t, dim=1), reduction="batchmean") * t * t
    per_sample = F.kl_div(F.log_softmax(student / t, dim=1), F.softmax(teacher / t, dim=1), reduction="none").sum(1)
    return (per_sample * mask).sum() / mask.sum() * t * t


def hpm_coefficient(mu: float, round: int, rounds: int) -> float:
    """mu_t = mu * t / T (t capped at T)."""
    return mu * min(round, rounds) / rounds


def fedphp_loss(settings: FedPHPSettings, body: int) -> LossFn:
    """(1 - lam) CE + lam KT(w, HPM), the HPM ``aux["hpm"]`` frozen."""
    lam, mmd = settings.lam, settings.kt == "mmd"

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        features = net(params, batch.x, stop=body)
        logits = net(params, features, start=body)
        with torch.no_grad():
            teacher = net(aux["hpm"], batch.x, stop=body if mmd else None)
        kt = (
            mmd_rbf(features, teacher, settings.bandwidths, batch.mask)
            if mmd
            else kd_loss(logits, teacher, settings.temperature, batch.mask)
        )
        return (1 - lam) * cross_entropy(logits, batch) + lam * kt

    return loss


@register
class FedPHP(Algorithm):
    name = "fedphp"
    settings_class = FedPHPSettings
    settings: FedPHPSettings

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": clone(init_params), "hpm": clone(init_params), "trained": clone(init_params)}

    def loss(self) -> LossFn:
        return fedphp_loss(self.settings, body=len(self.units) - 1)

    @property
    def pfllib2022(self) -> bool:
        return self.settings.variant == "pfllib2022"

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        """pfllib2022: w <- (1 - mu_R) Theta + mu_R w_old; otherwise the overwrite."""
        if not self.pfllib2022:
            return super().receive(payload, state, ctx)
        mu_r = hpm_coefficient(self.settings.mu, ctx.round - 1, self.train.rounds)
        old, received = state["model"], payload["global"]
        with torch.no_grad():
            blended = {**old, **{k: (1 - mu_r) * received[k] + mu_r * old[k] for k in received}}
        return {**state, "model": blended}, {"hpm_mu": mu_r}

    def loss_aux(self, payload: Payload, state: State, ctx: ClientContext) -> Any:
        # the teacher's training-mode forwards update its batch-norm statistics: give it a copy
        if self.pfllib2022:  # the teacher is the received global model
            return {"hpm": clone({**state["model"], **payload["global"]})}
        return {"hpm": clone(state["hpm"])}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        fit = self.train_model(
            state["model"],
            ctx,
            self.loss(),
            aux=self.loss_aux(payload, state, ctx),
            stage="local training (CE + knowledge transfer)",
        )
        w = fit.params
        if self.pfllib2022:
            return {**state, "model": w, "trained": w}, self.upload(w, ctx), {"train_loss": fit.loss}
        mu_t = hpm_coefficient(self.settings.mu, ctx.round, self.train.rounds)
        with torch.no_grad():
            new_hpm = {k: state["hpm"][k] * mu_t + w[k] * (1 - mu_t) for k in state["hpm"]}
        return (
            {**state, "model": w, "hpm": new_hpm, "trained": w},
            self.upload(w, ctx),
            {"train_loss": fit.loss, "hpm_mu": mu_t},
        )

    def eval_params(self, state: State) -> Params:
        if self.pfllib2022:  # scored after the blend, before training
            return state["model"]
        return state["hpm"] if self.settings.eval_hpm else state["trained"]


FedPHP.card = MethodCard(
    full_name="FedPHP",
    paper=Paper(
        "FedPHP: Federated Personalization with Inherited Private Models",
        "Li et al.",
        2021,
        "ECML PKDD",
        "https://doi.org/10.1007/978-3-030-86486-6_36",
    ),
    personalised=True,
    shares="The trained model w and its training-set size; the server averages them as FedAvg.",
    keeps="The inherited private model (HPM) v, and the model w it trained last.",
    scored="the locally trained w",
    scored_detail="w of the client's last participation (the initial model before it); `eval_hpm` scores v.",
    client_round="Overwrite w with the received global. Train E epochs on (1 − λ)CE + λ·MMD(features of "
    "w, of the frozen HPM v) (λ = 0.01). Then v ← μ_t v + (1 − μ_t) w, with μ_t = μ·t/T (μ = 0.9). "
    "Upload w.",
    references=(Reference("TsingZ0/PFLlib", "f1e313a", ("clients/clientphp.py",)),),
    tests=(
        "tests/methods/test_fedphp.py::"
        "test_fedphp_pfllib2022_blends_on_receive_scores_the_blend_and_distils_toward_the_global_model",
    ),
    differences=(
        "pflkit follows the paper: the global overwrites the local model, which trains with MMD toward "
        "the frozen HPM; the HPM follows the trained models.",
        "PFLlib's `clientphp.py` starts training from (1 − μ_t)·global + μ_t·old local and transfers "
        "knowledge toward the global model's features. The FedALA paper's FedPHP numbers probably come "
        "from that code (f1e313a, the last commit before the FedALA preprint); PFLlib changed it in "
        "December 2024.",
        '`fedphp.variant = "pfllib2022"` runs PFLlib\'s reading: on receiving, w ← (1 − μ_R)·Θ + μ_R·w_old '
        "with μ_R = μ·R/T and R counted from 0; w is scored then and trained on (1 − λ)·CE + λ·MMD(features "
        "of w, of Θ). The test above checks it.",
    ),
    choices=(
        Choice(
            "knowledge transfer",
            "MMD with RBF bandwidths {10, 15, 20, 50} on body features",
            '`kt = "kd"` (logit distillation, `temperature`)',
        ),
        Choice("evaluated model", "the trained local model", "`eval_hpm`"),
    ),
)

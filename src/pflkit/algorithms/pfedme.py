"""pFedMe (T Dinh et al., NeurIPS 2020): personalisation through Moreau envelopes.

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

from ..functional import Params, clone, weighted_average
from ..functional.training import Batch, Net, cross_entropy
from .base import Algorithm, ClientContext, Payload, SentUpload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .context import StepFn, TrainBatches
from .registry import register


class PFedMeSettings(Settings):
    personal_lr: float = Field(
        0.01, gt=0, description="eta_p, step size of the K inner steps on theta (FedALA App. G: 0.01)"
    )
    lam: float = Field(15.0, ge=0, description="lambda, Moreau-envelope regularisation (App. G: 15)")
    inner_steps: int = Field(5, ge=1, description="K, inner steps on theta per mini-batch (App. G: 5)")
    beta: float = Field(1.0, gt=0, le=1, description="server mixing (1 - beta) old + beta avg (App. G: 1.0)")
    l2: float = Field(
        0.0,
        ge=0,
        description="extra l2 * theta in the inner step; the reference uses 0.001 (default off)",
    )
    # the pFedMe paper averages uniformly over sampled clients, PFLlib weights by samples
    server_weights: Literal["samples", "uniform"] = Field(
        "samples",
        description="server average weighted by sample counts (PFLlib) or uniform over the sampled clients (paper)",
    )
    # with +ala (FedALA Table 4) only w is ALA-initialised; where theta starts is our choice
    theta_init: Literal["received", "local"] = Field(
        "received",
        description="theta's start each round: the received global or the "
        "(ALA-)initialised local w; identical without +ala",
    )


THETA = "pfedme.theta."  # prefix of the personalised copy in the parameters a fit trains


def pfedme_step(
    net: Net, names: list[str], personal_lr: float, lam: float, inner_steps: int, l2: float, lr: float
) -> StepFn:
    """One pFedMe mini-batch: K steps on theta toward min f(theta) + lam/2 ||theta - w||^2 (+ l2 theta),
    then w <- w - lr * lam * (w - theta); a pure function of the batch."""

    def loss(theta: Params, frozen: Params, batch: Batch) -> torch.Tensor:
        return cross_entropy(net({**frozen, **theta}, batch.x), batch)

    def step(value_and_grad, train, frozen, batch, aux):
        w = {k: train[k] for k in names}
        theta = {k: train[THETA + k] for k in names}
        losses = []
        for _ in range(inner_steps):
            g, value = value_and_grad(loss)(theta, frozen, batch)
            # theta - eta_p (g + lam (theta - w) + l2 theta) in two passes over each parameter
            # instead of five: a lerp toward w, then the gradient step
            pulled = {k: torch.lerp(theta[k], w[k], personal_lr * lam) for k in names}
            if l2:
                pulled = {k: pulled[k].add_(theta[k], alpha=-personal_lr * l2) for k in names}
            theta = {k: pulled[k].add_(g[k], alpha=-personal_lr) for k in names}
            losses.append(value)
        w = {k: torch.lerp(w[k], theta[k], lr * lam) for k in names}
        # reported: the last inner loss; the others enter as 0 * loss so that a NaN still stops the run
        return {**w, **{THETA + k: theta[k] for k in names}}, losses[-1] + 0.0 * sum(losses[:-1])

    return step


@register
class PFedMe(Algorithm):
    name = "pfedme"
    settings_class = PFedMeSettings
    settings: PFedMeSettings

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": clone(init_params), "personal": clone(init_params)}

    def newcomer_state(self, init_params: Params, payload: Payload, client_id: int) -> State:
        """A newcomer's personalised model starts from the received global model (a participant's is
        the inner solution of its last round)."""
        state = self.init_client(init_params, client_id)
        return {**state, "personal": {**state["personal"], **clone(payload["global"])}}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        weights = (
            [u["num_samples"] for u in uploads] if self.settings.server_weights == "samples" else [1.0] * len(uploads)
        )
        avg = weighted_average([u["params"] for u in uploads], weights)
        beta, old = self.settings.beta, server["global"]
        trainable = set(self.parameter_names)
        if beta != 1.0:  # buffers (batch-norm statistics) take the plain average
            avg = {k: (old[k] * (1.0 - beta) + v * beta if k in trainable else v) for k, v in avg.items()}
        return {**server, "global": {**old, **avg}}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        cfg = self.settings
        names = self.parameter_names
        start = payload["global"] if cfg.theta_init == "received" else state["model"]
        params = {**state["model"], **{THETA + k: start[k] for k in names}}
        step = pfedme_step(ctx.net, names, cfg.personal_lr, cfg.lam, cfg.inner_steps, cfg.l2, ctx.train.lr)
        fit = ctx.fit(
            params,
            step=step,
            trainable=names + [THETA + k for k in names],
            data=TrainBatches("train", self.train.local_epochs),
            stage="local training (personalised inner steps)",
        )
        w = {k: fit.params[k] for k in state["model"]}
        theta = {**w, **{k: fit.params[THETA + k] for k in names}}
        return {**state, "model": w, "personal": theta}, self.upload(w, ctx), {"train_loss": fit.loss}

    def eval_params(self, state: State) -> Params:
        return state["personal"]


PFedMe.card = MethodCard(
    full_name="pFedMe",
    paper=Paper(
        "Personalized Federated Learning with Moreau Envelopes",
        "T Dinh et al.",
        2020,
        "NeurIPS",
        "https://arxiv.org/abs/2006.08848",
    ),
    personalised=True,
    shares="The local model w and its training-set size.",
    keeps="The personalised model θ.",
    scored="the personalised θ",
    scored_detail="θ of the client's last training, as the paper. PFLlib scores the received global "
    "(docs/explanations/reconstructions.md).",
    client_round="Reset w to the received global. Per batch: K = 5 steps on θ (η_p = 0.01, λ = 15), "
    "then w ← w − lr·λ(w − θ). Upload w. The server mixes (1 − β)·old + β·average (β = 1: FedAvg).",
    references=(
        Reference(
            "TsingZ0/PFLlib",
            "f1e313a",
            ("clients/clientpFedMe.py", "optimizers/fedoptimizer.py (pFedMeOptimizer)", "servers/serverpFedMe.py"),
        ),
    ),
    tests=(
        "tests/methods/test_pfedme.py::test_pfedme_is_pfllib_inner_steps_with_its_l2_term_local_update_and_beta_server",
    ),
    differences=(
        "The reference's 0.001·θ term is off by default; the transcription test sets `pfedme.l2 = 0.001`.",
        "The scored model differs (above).",
    ),
    choices=(
        Choice("server weights", "sample-weighted (PFLlib)", '`server_weights = "uniform"` (the paper)'),
        Choice("the reference's 0.001·θ term", "off", "`l2 = 0.001`"),
    ),
    notes=("`train_loss` is the last inner loss per batch.",),
    ala_initialises="the local w (`theta_init`: θ starts at the received global, or at w)",
    step_function=True,
)

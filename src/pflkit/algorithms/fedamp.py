"""FedAMP (Huang et al., AAAI 2021): attentive message passing between similar clients (spec §2.8).

The server keeps every client's latest model w_j and sends client i its personalised cloud model
u_i = sum_j xi_ij w_j with xi_ij = alpha_k * A'(||w_i - w_j||^2) (j != i), A'(x) = exp(-x/sigma)/sigma,
xi_ii = 1 - sum_{j != i} xi_ij. The client does not overwrite its model: from its own w_i it
trains E epochs on F_i(w) + lambda/(2 alpha_k) ||w - u_i||^2 and uploads w_i. Every client must
take part in every round (cross-silo). Evaluated model: w_i. With ``+ala`` ALA blends u_i into
w_i to form the start point of training (spec §1.8 [RECON]).
"""

from __future__ import annotations

import logging
import math

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, check_finite, clone
from .base import Algorithm, ClientContext, ClientSummary, Payload, Settings, State, Upload
from .registry import register

log = logging.getLogger(__name__)


class FedAMPSettings(Settings):
    alpha_k: float = Field(1000.0, gt=0, description="alpha_k, server step size (App. G: 1000)")
    lam: float = Field(1.0, ge=0, description="lambda; the proximal weight is lambda/alpha_k (App. G: 1)")
    sigma: float = Field(0.1, gt=0, description="sigma of the attention function A(x) = 1 - exp(-x/sigma)")
    convex: bool = Field(True, description="when sum_{j!=i} xi_ij > 1, scale those coefficients to sum to 1 "
                         "(xi_ii = 0) so u_i stays a convex combination; False = the literal formula, whose "
                         "negative xi_ii extrapolates and can diverge [ours; spec §2.8, §9.4]")
    squared_prox: bool = Field(True, description="squared norm in the proximal term (paper); False = the "
                               "non-squared norm ||w - u_i|| with its gradient (the form of PFLlib's term, whose "
                               "detached tensors give it no gradient at all: lam = 0 reproduces PFLlib) "
                               "[spec §2.8; docs/algorithms.md]")


def squared_distance(a: Params, b: Params) -> float:
    return float(sum(torch.sum((a[k] - b[k]) ** 2) for k in a))


@register
class FedAMP(Algorithm):
    name = "fedamp"
    settings_class = FedAMPSettings
    settings: FedAMPSettings
    ala_targets = {"model": ("cloud", "model")}
    requires_full_participation = True

    @property
    def supports_batching(self) -> bool:  # type: ignore[override]
        return self.settings.squared_prox  # the non-squared proximal term needs its own loop

    _warned = False

    def prepare(self, server: State, clients: list[ClientSummary]) -> State:
        """Every client starts from Theta^0, so the server knows all models before round 1."""
        return {**server, "models": {c.client_id: server["global"] for c in clients}}

    def coefficients(self, server: State, client_id: int) -> dict[int, float]:
        """xi_{i, .} (spec §2.8); warns when xi_ii < 0 (alpha_k too large for these distances)."""
        cfg, models = self.settings, server["models"]
        own = models[client_id]
        xi = {j: cfg.alpha_k * math.exp(-squared_distance(own, w) / cfg.sigma) / cfg.sigma
              for j, w in models.items() if j != client_id}
        others = sum(xi.values())
        if others > 1 and cfg.convex:
            log.debug("FedAMP: client %d: sum of xi_ij = %.4g > 1 scaled to 1 (xi_ii = 0)", client_id, others)
            xi = {j: v / others for j, v in xi.items()}
            others = 1.0
        xi[client_id] = 1.0 - others
        if xi[client_id] < 0 and not self._warned:
            self._warned = True
            log.warning("FedAMP: xi_ii = %.4g < 0 for client %d (alpha_k=%g, sigma=%g): the cloud model "
                        "extrapolates away from the client's own model (fedamp.convex=true prevents it)",
                        xi[client_id], client_id, cfg.alpha_k, cfg.sigma)
        return xi

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        xi = self.coefficients(server, client_id)
        models = server["models"]
        own = models[client_id]
        cloud = {k: sum(xi[j] * models[j][k] for j in models) for k in own}
        return {"cloud": cloud}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        return state  # FedAMP keeps its own model; the cloud model only anchors training

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        return self.keep_latest_models(server, uploads)

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        cfg = self.settings
        mu = cfg.lam / cfg.alpha_k
        if cfg.squared_prox:
            params, loss = ctx.sgd(state["model"], epochs=self.train.local_epochs, prox_anchor=payload["cloud"],
                                   prox_mu=mu)
        else:
            params, loss = self._train_norm_prox(state["model"], payload["cloud"], mu, ctx)
        return {**state, "model": params}, self.upload(params, ctx), {"train_loss": loss}

    def _train_norm_prox(self, params: Params, cloud: Params, mu: float,
                         ctx: ClientContext) -> tuple[Params, float]:
        """SGD on F_i(w) + lambda/(2 alpha_k) ||w - u_i|| (non-squared norm, with its gradient)."""
        names = [n for _, members in self.units for n in members]
        work = clone(params)
        for n in names:
            work[n].requires_grad_(True)
        leaves = [work[n] for n in names]
        loss_sum, count = torch.zeros((), device=leaves[0].device), 0
        for x, y in ctx.batches("train", self.train.local_epochs):
            ce = F.cross_entropy(ctx.logits(work, x), y)
            dist = torch.sqrt(sum(torch.sum((work[n] - cloud[n]) ** 2) for n in names) + 1e-12)
            grads = torch.autograd.grad(ce + mu / 2 * dist, leaves)
            with torch.no_grad():
                torch._foreach_add_(leaves, list(grads), alpha=-self.train.lr)
            loss_sum += ce.detach()
            count += 1
        check_finite(loss_sum, ctx.where("local training"))
        return {k: v.detach() for k, v in work.items()}, float(loss_sum) / max(count, 1)

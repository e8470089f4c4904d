"""FedAMP (Huang et al., AAAI 2021): attentive message passing between similar clients.

The server keeps every client's latest model w_j and sends client i its personalised cloud model
u_i = sum_j xi_ij w_j with xi_ij = alpha_k * A'(||w_i - w_j||^2) (j != i), A'(x) = exp(-x/sigma)/sigma,
xi_ii = 1 - sum_{j != i} xi_ij. The client does not overwrite its model: from its own w_i it
trains E epochs on F_i(w) + lambda/(2 alpha_k) ||w - u_i||^2 and uploads w_i. Every client must
take part in every round (cross-silo). Evaluated model: w_i. With ``+ala`` ALA blends u_i into
w_i to form the start point of training.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from pydantic import Field

from ..functional import Params
from ..functional.training import Batch, LossFn, Net, classification_loss, proximal_loss, squared_distance
from .base import Algorithm, ClientContext, ClientSummary, Init, Payload, SentUpload, Settings, State
from .card import Choice, MethodCard, Paper, Reference
from .registry import register

log = logging.getLogger(__name__)


class FedAMPSettings(Settings):
    alpha_k: float = Field(1000.0, gt=0, description="alpha_k, server step size (App. G: 1000)")
    lam: float = Field(1.0, ge=0, description="lambda; the proximal weight is lambda/alpha_k (App. G: 1)")
    sigma: float = Field(0.1, gt=0, description="sigma of the attention function A(x) = 1 - exp(-x/sigma)")
    convex: bool = Field(
        True,
        description="when sum_{j!=i} xi_ij > 1, scale those coefficients to sum to 1 "
        "(xi_ii = 0) so u_i stays a convex combination; False = the literal formula, whose "
        "negative xi_ii extrapolates and can diverge (pflkit's)",
    )
    squared_prox: bool = Field(
        True,
        description="squared norm in the proximal term (paper); False = the "
        "non-squared norm ||w - u_i|| with its gradient (the form of PFLlib's term, whose "
        "detached tensors give it no gradient at all: lam = 0 reproduces PFLlib; "
        "docs/reference/methods/fedamp.md)",
    )


def norm_proximal_loss(mu: float) -> LossFn:
    """Cross-entropy + mu/2 ||w - u_i|| (the non-squared norm, with its gradient)."""

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        cloud = aux["anchor"]
        distance = torch.sqrt(squared_distance({k: params[k] for k in cloud}, cloud) + 1e-12)
        return classification_loss(net, params, batch) + mu / 2 * distance

    return loss


@register
class FedAMP(Algorithm):
    name = "fedamp"
    settings_class = FedAMPSettings
    settings: FedAMPSettings
    ala_targets = {"model": ("cloud", "model")}
    requires_full_participation = True
    newcomer_refusal = "fedamp sends each client a cloud model built from that client's own model on the server"
    _warned = False

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        """Every client starts from Theta^0, so the server knows all models before round 1."""
        return {**server, "models": {c.client_id: server["global"] for c in clients}}

    def coefficients(self, server: State, client_id: int) -> dict[int, float]:
        """xi_{i, .}; warns when xi_ii < 0 (alpha_k too large for these distances)."""
        cfg, models = self.settings, server["models"]
        own = models[client_id]
        xi = {
            j: cfg.alpha_k * math.exp(-float(squared_distance(own, w)) / cfg.sigma) / cfg.sigma
            for j, w in models.items()
            if j != client_id
        }
        others = sum(xi.values())
        if others > 1 and cfg.convex:
            log.debug("FedAMP: client %d: sum of xi_ij = %.4g > 1 scaled to 1 (xi_ii = 0)", client_id, others)
            xi = {j: v / others for j, v in xi.items()}
            others = 1.0
        xi[client_id] = 1.0 - others
        if xi[client_id] < 0 and not self._warned:
            self._warned = True
            log.warning(
                "FedAMP: xi_ii = %.4g < 0 for client %d (alpha_k=%g, sigma=%g): the cloud model "
                "extrapolates away from the client's own model (fedamp.convex=true prevents it)",
                xi[client_id],
                client_id,
                cfg.alpha_k,
                cfg.sigma,
            )
        return xi

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        xi = self.coefficients(server, client_id)
        models = server["models"]
        own = models[client_id]
        cloud = {k: sum(xi[j] * models[j][k] for j in models) for k in own}
        return {"cloud": cloud}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        return state, {}  # FedAMP keeps its own model; the cloud model only anchors training

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        return self.keep_latest_models(server, uploads)

    def loss(self) -> LossFn:
        mu = self.settings.lam / self.settings.alpha_k
        if self.settings.squared_prox:
            return proximal_loss(classification_loss, mu)
        return norm_proximal_loss(mu)

    def loss_aux(self, payload: Payload, state: State, ctx: ClientContext) -> Any:
        return {"anchor": self.parameters_of(payload["cloud"])}


FedAMP.card = MethodCard(
    full_name="FedAMP",
    paper=Paper(
        "Personalized Cross-Silo Federated Learning on Non-IID Data",
        "Huang et al.",
        2021,
        "AAAI",
        "https://arxiv.org/abs/2007.03797",
    ),
    personalised=True,
    shares="Its model; the server keeps every client's latest model and sends each a personalised cloud model.",
    keeps="Its own model, which the download never overwrites.",
    scored="the local model",
    client_round="Keep the own model w. Train E epochs of SGD on F + λ/(2α_k)‖w − u_i‖² toward the cloud "
    "model u_i = Σ ξ_ij w_j (α_k = 1000, λ = 1, σ = 0.1). Upload the model.",
    references=(Reference("TsingZ0/PFLlib", "f1e313a", ("clients/clientamp.py", "servers/serveramp.py")),),
    tests=("tests/methods/test_fedamp.py::test_fedamp_cloud_coefficients_and_client_step_match_pfllib",),
    pinned=("tests/methods/test_fedamp.py::test_fedamp_two_rounds_match_pfllib_f1e313a",),
    differences=(
        "The transcription test sets `convex = false`.",
        "At f1e313a the proximal term is the squared norm with its gradient, pflkit's default. PFLlib "
        "detached it from 45ae9f5 (March 2023) on.",
        "At f1e313a ξ_ii multiplies the client's previous cloud model (the initial model, never reset) "
        "instead of its own model; PFLlib fixed this in 0998c54 (April 2023). pflkit uses the paper's "
        "ξ_ii·w_i. The two agree in round 1.",
    ),
    choices=(
        Choice(
            "coefficients when Σ_{j≠i} ξ_ij > 1 (ξ_ii < 0 extrapolates; with α_k = 1000, σ = 0.1 this "
            "happens for nearly identical models)",
            "scaled to sum to 1 (ξ_ii = 0)",
            "`convex = false` (the literal formula, with a warning)",
        ),
        Choice(
            "proximal norm",
            "squared (the paper). PFLlib at f1e313a has the squared norm with its gradient. From 45ae9f5 "
            "on, its term is built from detached tensors (`p.data`): a constant without gradient, so its "
            "clients train with plain SGD from their own model. `fedamp.lam = 0` reproduces that version.",
            "`squared_prox = false`: the non-squared norm ‖w − u_i‖, with its gradient (pflkit's)",
        ),
    ),
    notes=("`train_loss` includes the proximal term.",),
    ala_initialises="the local model, blending the cloud model u_i into it",
)

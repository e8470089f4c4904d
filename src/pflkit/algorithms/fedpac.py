"""FedPAC (Xu et al., ICLR 2023): feature alignment to global class prototypes and classifier
collaboration, as the authors' code runs it (JianXu95/FedPAC, commit 5770f4f: ``methods/fedpac.py``,
``tools.py``, ``running.py``).

Client round, from the received model (the global body with the client's combined head):

1. statistics of the received model on the client's training data, h the body's output: per class k
   the feature mean mu_k, the label share p_k, V = (sum_k p_k E[|h|^2 | k] - p_k^2 |mu_k|^2) / n and
   the rows p_k mu_k (n: the client's training samples);
2. ``head_epochs`` epochs of cross-entropy on the head alone at ``head_lr``, the body frozen;
3. E epochs of the body alone, the head frozen, on CE + lambda mean_d (h - c_y)^2, c_y the global
   prototype of class y (the client's own mean mu_y of step 1 where the server has none); round 1
   trains on CE alone;
4. upload the model, the statistics of step 1, and the per-class feature means after training with
   the class counts.

Server: the sample-weighted average of the models (the body every client downloads); the global
prototype of a class is the class-count-weighted mean of the clients' means, over this round's
participants that hold it; each participant i gets the head sum_j a_ij g_j / sum_j a_ij of the
participants' trained heads g_j, with a_i = argmin a^T (diag(V) + D_i) a over the simplex,
D_i[j, l] = sum_k <p_ik mu_ik - p_jk mu_jk, p_ik mu_ik - p_lk mu_lk>, weights of at most 1e-3 zeroed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import Field
from scipy.optimize import minimize

from ..functional import Params
from ..functional.training import Batch, LossFn, Net, classification_loss, cross_entropy, label_loss
from ..models import head_names
from .base import Algorithm, ClientContext, ClientSummary, Payload, SentUpload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .registry import register

HEADS = "fedpac.heads"  # server state: client id -> the head that client receives next
PROTOS = "fedpac.prototypes"  # server state and payload: the global prototypes [C, d]
SEEN = "fedpac.seen"  # server state and payload: which classes have a global prototype [C]


class FedPACSettings(Settings):
    lam: float = Field(1.0, ge=0, description="λ, the weight of the feature-alignment term (the authors' code: 1)")
    head_epochs: int = Field(
        1, ge=1, description="epochs of the head alone, the body frozen, before the body's (the authors' code: 1)"
    )
    head_lr: float = Field(
        0.1, gt=0, description="learning rate of the head epochs (the authors' code: 0.1, whatever the run's lr)"
    )
    collaborate: bool = Field(
        True,
        description="combine the participants' heads with the weights of each client's quadratic programme "
        "(the authors' agg_g = 1); false: each client keeps the head it trained",
    )
    min_weight: float = Field(
        1e-3, ge=0, lt=1, description="combination weights at or below this are zeroed (the authors' code: 1e-3)"
    )


def feature_moments(body: int) -> Any:
    """Per sample, the body's output h (flattened) and |h|^2: [b, d + 1] (a ``class_sums`` map)."""

    def fn(net: Net, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = net(params, x, stop=body, train=False).flatten(1)
        return torch.cat([h, (h * h).sum(1, keepdim=True)], dim=1)

    return fn


def feature_statistics(
    moments: torch.Tensor, counts: torch.Tensor, num: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From per-class sums of ``feature_moments`` [.., C, d + 1], the class counts [.., C] and the
    training-set size [..]: the class means mu_k [.., C, d] (0 for an absent class), the variance
    term V = (sum_k p_k E[|h|^2 | k] - p_k^2 |mu_k|^2) / n [..] and the rows p_k mu_k [.., C, d]."""
    d = moments.shape[-1] - 1
    per_class = counts.clamp(min=1)
    means = moments[..., :d] / per_class[..., None]
    second = moments[..., d] / per_class
    share = counts / num[..., None]
    variance = (share * second - share**2 * (means**2).sum(-1)).sum(-1) / num
    return means, variance, share[..., None] * means


def alignment_loss(lam: float, body: int) -> LossFn:
    """CE + λ mean over the features of (h - c_y)^2, the targets c [C, d] in ``aux["targets"]``."""

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        z = net(params, batch.x, stop=body)
        h, targets = z.flatten(1), aux["targets"]
        align = label_loss(lambda y: ((h - targets[y]) ** 2).mean(-1), batch)
        return cross_entropy(net(params, z, start=body), batch) + lam * align

    return loss


def simplex_qp(p: np.ndarray) -> np.ndarray | None:
    """argmin_a a^T p a subject to a >= 0, sum(a) = 1, by SLSQP (scipy). A matrix with a negative
    eigenvalue is first replaced by its part of eigenvalues >= 0.01 (the authors' code). None where
    nothing of it remains or the solver fails (the client then keeps its own head)."""
    p = (p + p.T) / 2
    values, vectors = np.linalg.eigh(p)
    if values.min() < 0:
        keep = values >= 0.01
        if not keep.any():
            return None
        p = (vectors[:, keep] * values[keep]) @ vectors[:, keep].T
    m = len(p)
    q = p / max(float(np.abs(p).max()), 1e-300)  # the same minimiser, an objective of order one
    result = minimize(
        lambda a: a @ q @ a,
        np.full(m, 1.0 / m),
        jac=lambda a: 2 * q @ a,
        bounds=[(0.0, 1.0)] * m,
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones_like(a)}],
        method="SLSQP",
        options={"ftol": 1e-14, "maxiter": 1000},
    )
    if not result.success:
        return None
    weights = np.clip(result.x, 0.0, None)
    return np.asarray(weights / weights.sum())


def collaboration_weights(variances: np.ndarray, rows: np.ndarray, min_weight: float) -> list[np.ndarray | None]:
    """Per client i of M, its head-combination weights over the M clients: ``simplex_qp`` of
    diag(V) + D_i, D_i[j, l] = <r_i - r_j, r_i - r_l>, weights at or below ``min_weight`` zeroed.
    ``variances``: V [M]; ``rows``: the flattened p_k mu_k of each client [M, C * d]."""
    out: list[np.ndarray | None] = []
    for i in range(len(rows)):
        gaps = rows[i] - rows
        weights = simplex_qp(np.diag(variances) + gaps @ gaps.T)
        kept = None if weights is None else np.where(weights > min_weight, weights, 0.0)
        # every weight at or below the cut (many near-equal clients): the unzeroed weights, never 0 / 0
        out.append(weights if kept is not None and kept.sum() == 0 else kept)
    return out


@register
class FedPAC(Algorithm):
    name = "fedpac"
    settings_class = FedPACSettings
    settings: FedPACSettings

    body_use = "aligns the features the model's body computes before its head"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head = head_names(self.units)
        self.body = len(self.units) - 1

    def init_server(self, init_params: Params) -> State:
        weight = init_params[self.head[0]]
        if weight.dim() != 2:
            raise ValueError(
                f"fedpac needs a linear head (a [classes, features] weight); {self.head[0]!r} has shape "
                f"{tuple(weight.shape)}"
            )
        server = super().init_server(init_params)
        return {
            **server,
            PROTOS: torch.zeros_like(weight),
            SEEN: torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device),
        }

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        """Every client starts with the initial head (a client that never trained keeps it)."""
        head = {k: server["global"][k] for k in self.head}
        return {**server, HEADS: {c.client_id: head for c in clients}}

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        """The global body with the client's combined head (a client the server has no head for,
        one that never trains: the global model's, the sample-weighted average of the heads)."""
        received = super().downlink(server, client_id, round)["global"]
        head = server.get(HEADS, {}).get(client_id)
        model = received if head is None else {**received, **head}
        return {"global": model, PROTOS: server[PROTOS], SEEN: server[SEEN]}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        cfg = self.settings
        model = state["model"]
        moments = ctx.class_sums(model, feature_moments(self.body))
        counts = ctx.label_counts.to(moments.dtype)
        means, variance, rows = feature_statistics(moments, counts, ctx.num_train.to(moments.dtype))
        head_fit = self.train_model(
            model,
            ctx,
            classification_loss,
            purpose="head",
            epochs=cfg.head_epochs,
            trainable=self.head,
            stage="head training",
            optimizer=ctx.train.optimizer(cfg.head_lr),
            start=self.body,
        )
        loss: LossFn = classification_loss
        aux = None
        if ctx.round > 1:  # round 1 has no global prototypes: the authors' alignment term is 0
            loss = alignment_loss(cfg.lam, self.body)
            aux = {"targets": torch.where(payload[SEEN][..., None], payload[PROTOS].to(means), means)}
        body = [k for k in self.parameter_names if k not in self.head]
        fit = self.train_model(head_fit.params, ctx, loss, aux=aux, trainable=body, stage="body training")
        after = ctx.class_sums(fit.params, feature_moments(self.body))[..., :-1]
        upload = self.upload(
            fit.params,
            ctx,
            variance=variance,
            class_rows=rows,
            class_means=after / counts.clamp(min=1)[..., None],
            class_counts=counts,
        )
        return {**state, "model": fit.params}, upload, {"train_loss": fit.loss, "head_loss": head_fit.loss}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        new = super().aggregate(server, uploads, round)
        uploads = sorted(uploads, key=lambda u: u["client_id"])
        # the ignores: class_counts, class_means, variance and class_rows are FedPAC's own upload keys
        counts = torch.stack([u["class_counts"] for u in uploads])  # type: ignore[typeddict-item]
        means = torch.stack([u["class_means"] for u in uploads])  # type: ignore[typeddict-item]
        total = counts.sum(0)
        protos = (counts[..., None] * means).sum(0) / total.clamp(min=1)[:, None]
        heads = dict(server.get(HEADS, {}))
        own = [{k: u["params"][k] for k in self.head} for u in uploads]
        weights: list[np.ndarray | None] = [None] * len(uploads)
        if self.settings.collaborate:
            variances = np.array([float(u["variance"]) for u in uploads])  # type: ignore[typeddict-item]
            rows = torch.stack([u["class_rows"].flatten() for u in uploads])  # type: ignore[typeddict-item]
            weights = collaboration_weights(variances, rows.double().cpu().numpy(), self.settings.min_weight)
        for u, head, w in zip(uploads, own, weights):
            heads[u["client_id"]] = head if w is None else combine(own, w)
        seen = total > 0
        return {**new, HEADS: heads, PROTOS: protos.to(server[PROTOS]), SEEN: seen.to(server[SEEN].device)}


def combine(heads: list[Params], weights: np.ndarray) -> Params:
    """sum_j w_j g_j / sum_j w_j over the heads g_j."""
    total = float(weights.sum())
    out = {}
    for k in heads[0]:
        acc = torch.zeros_like(heads[0][k])
        for w, g in zip(weights, heads):
            acc = acc + float(w) * g[k]
        out[k] = acc / total
    return out


FedPAC.card = MethodCard(
    full_name="FedPAC",
    paper=Paper(
        "Personalized Federated Learning with Feature Alignment and Classifier Collaboration",
        "Xu et al.",
        2023,
        "ICLR",
        "https://arxiv.org/abs/2306.11867",
    ),
    personalised=True,
    shares="Its model, its per-class feature means with the class counts, and the feature statistics of the "
    "received model (a variance term and the label-share-weighted class means).",
    keeps="Nothing the server does not hold: the server keeps each client's combined head and sends it back.",
    scored="the global body with the client's combined head",
    client_round="Take the received global body and the client's combined head. Measure the received model's "
    "feature statistics. Train the head alone for 1 epoch at lr 0.1, then the body alone for E epochs on "
    "CE + λ·mean (h − c_y)² toward the global prototype c_y of each sample's class (λ = 1; round 1: CE alone). "
    "Upload the model, the statistics and the per-class feature means. The server averages the models and "
    "the prototypes, and gives each participant the combination of the participants' heads whose weights "
    "solve its quadratic programme over the simplex (scipy's SLSQP).",
    references=(
        Reference(
            "JianXu95/FedPAC",
            "5770f4f",
            (
                "methods/fedpac.py (LocalUpdate_FedPAC)",
                "tools.py (protos_aggregation, get_head_agg_weight, agg_classifier_weighted_p)",
                "running.py (train_round_fedpac)",
            ),
        ),
    ),
    tests=(
        "tests/methods/test_fedpac.py::test_fedpac_client_round_matches_the_authors_local_training",
        "tests/methods/test_fedpac.py::test_fedpac_statistics_match_the_authors_statistics_extraction",
        "tests/methods/test_fedpac.py::test_fedpac_server_matches_the_authors_round",
        "tests/methods/test_fedpac.py::test_fedpac_quadratic_programme_matches_cvxpy_on_a_fixed_example",
    ),
    differences=(
        "The authors solve each client's quadratic programme with cvxpy; pflkit uses scipy's SLSQP "
        "(the same weights to 1e-4 on the test's example).",
        "Where the matrix of a client's programme has a negative eigenvalue, both keep its part of eigenvalues "
        ">= 0.01; the authors then test it again in float32 and give the client its own head when a rounding "
        "error turns an eigenvalue negative, pflkit solves the programme on it.",
        "The authors train with SGD momentum 0.5 and weight decay 5e-4 in both phases; pflkit uses the run's "
        "optimiser settings (the head epochs at `fedpac.head_lr`).",
        "The authors' training runs in evaluation mode (the test before training switches the model); "
        "pflkit trains in training mode (different only with batch norm or dropout).",
        "The authors train on every batch, the last one smaller; pflkit on full batches. Their head and body "
        "phases reshuffle one loader, pflkit's draw separate shuffles (the same distribution).",
        "The authors set the non-participants' bodies to the global one at the end of each round; pflkit "
        "sends the body when a client takes part, before it is scored (the same scored model).",
        "A class no client of the previous round held has no global prototype: pflkit aligns the client's "
        "features of that class with its own mean before training. The authors' code stops there (a "
        "KeyError in `update_global_protos`).",
    ),
    choices=(
        Choice(
            "a client that never trained (`[run] unseen_clients`)",
            "the global body with the global head (the sample-weighted average of the heads)",
        ),
        Choice("classifier collaboration", "on (the authors' agg_g = 1)", "`fedpac.collaborate = false`"),
    ),
    notes=(
        "`train_loss` includes λ times the alignment term; `head_loss` is the head epochs' loss.",
        "The server keeps each client's combined head and the global prototypes: checkpoints carry them and a "
        "resumed run continues them.",
        "A client that has not trained yet receives the initial head, as in the authors' code.",
        "The global model, scored on the global test data, is the sample-weighted average of the models, "
        "heads included (the authors' server computes it too, and sends only its body).",
    ),
    ala_initialises="the local model, blending the received body and combined head into it",
)

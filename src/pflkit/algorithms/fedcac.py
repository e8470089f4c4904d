"""FedCAC (Wu et al., ICCV 2023): cautiously aggressive collaboration on critical parameters.

Client: train the received model for E epochs; mark in every parameter tensor the critical entries,
the top tau fraction by |(theta - theta_0) * theta| (theta_0 the received model; where that
threshold is 0, the smallest positive value); upload the model and the mask. Server: the global
model is FedAvg's; client i's overlap with j is 1 - |m_i - m_j|_1 / (2 |m_i|_1); with the threshold
avg + (t / beta) (max - avg) over the pairs' overlaps in round t, client i's customised model is the
plain mean of its own upload and those of the clients it overlaps with at least that much. Client i
then receives its customised model at its critical entries and the global model elsewhere. Every
client takes part in every round (the authors' server uses every client's mask).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from .base import ROUND_INFO, Algorithm, ClientContext, Payload, SentUpload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .registry import register

MASK = "critical"  # the upload's entry: the critical mask of every parameter tensor


class FedCACSettings(Settings):
    tau: float = Field(
        0.5, gt=0, le=1, description="τ, the fraction of each parameter tensor marked critical (CIFAR-10: 0.5)"
    )
    beta: int = Field(
        100,
        ge=1,
        description="β: the overlap threshold moves from the mean towards the maximum overlap by t/β "
        "in round t, so collaboration on critical parameters narrows (CIFAR-10: 100, CIFAR-100: 170)",
    )


def critical_mask(new: torch.Tensor, old: torch.Tensor, tau: float, lead: int) -> torch.Tensor:
    """The critical entries of one parameter tensor (bool, ``new``'s shape): c = |(new - old) * new|
    at or above the int(tau n)-th largest value of the tensor (per client: ``lead`` leading dims);
    where that value is at most 1e-10, the smallest value above 1e-20 (if any) replaces it. A tensor
    of fewer than 1/tau entries has no critical entry."""
    c = ((new - old) * new).abs()
    flat = c.flatten(lead)
    nz = int(tau * flat.shape[-1])
    if nz == 0:
        return torch.zeros_like(c, dtype=torch.bool)
    thresh = flat.topk(nz, dim=-1).values[..., -1:]
    positive = torch.where(flat > 1e-20, flat, torch.full_like(flat, torch.inf)).amin(-1, keepdim=True)
    thresh = torch.where((thresh <= 1e-10) & positive.isfinite(), positive, thresh)
    return (flat >= thresh).reshape(c.shape)


def overlaps(masks: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """[N, N] float32: 1 - sum |m_i - m_j| / (2 sum m_i) between the clients' masks (the diagonal
    is 1); a client without critical entries overlaps no one (0)."""
    inner = torch.zeros(len(masks), len(masks), dtype=torch.int64)
    for name in masks[0]:  # one tensor at a time: the masks of a large model never sit in one matrix
        m = torch.stack([mask[name].reshape(-1) for mask in masks]).to(torch.float32)
        inner += (m @ m.T).round().to(torch.int64).cpu()  # (exact: counts below 2**24 per tensor)
    size = inner.diagonal()
    distance = size[:, None] + size[None, :] - 2 * inner  # |m_i - m_j|_1 for 0/1 masks
    rate = 1 - distance.to(torch.float32) / (2 * size[:, None]).clamp(min=1).to(torch.float32)
    return torch.where(size[:, None] > 0, rate, torch.zeros_like(rate))


def collaboration_threshold(rate: torch.Tensor, round: int, beta: int) -> float:
    """mean + (round / beta) (max - mean) over the overlaps between distinct clients (float32, as
    the authors compute it); infinite for a single client."""
    n = len(rate)
    if n < 2:
        return float("inf")
    pairs = rate[~torch.eye(n, dtype=torch.bool)].reshape(n, n - 1)
    mean = pairs.sum() / ((n - 1) * n)
    return float(mean + round / beta * (pairs.max() - mean))


@register
class FedCAC(Algorithm):
    name = "fedcac"
    settings_class = FedCACSettings
    settings: FedCACSettings
    requires_full_participation = True

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        received = state["model"]
        fit = self.train_model(received, ctx, self.loss())
        lead = len(ctx.client_shape)
        mask = {k: critical_mask(fit.params[k], received[k], self.settings.tau, lead) for k in self.parameter_names}
        upload = self.upload(fit.params, ctx, **{MASK: mask})
        return {**state, "model": fit.params}, upload, {"train_loss": fit.loss}

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        payload = super().downlink(server, client_id, round)
        own = server.get("models", {}).get(client_id)
        if own is None:  # before the first aggregation: the global model
            return payload
        return {"global": {**payload["global"], **{k: own[k] for k in payload["global"] if k in own}}}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        server = {k: v for k, v in super().aggregate(server, uploads, round).items() if k != ROUND_INFO}
        uploads = sorted(uploads, key=lambda u: u["client_id"])
        masks: list[dict[str, torch.Tensor]] = [u[MASK] for u in uploads]  # type: ignore[literal-required]
        rate = overlaps(masks)
        n = len(uploads)
        threshold = collaboration_threshold(rate, round, self.settings.beta)
        glob = server["global"]
        models = {}
        sizes = []
        for i, upload in enumerate(uploads):
            partners = [i] + [j for j in range(n) if j != i and float(rate[i, j]) >= threshold]
            sizes.append(len(partners))
            combined = {}
            for k in self.parameter_names:
                customised = sum_in_order([uploads[j]["params"][k] for j in partners]) / float(len(partners))
                combined[k] = torch.where(masks[i][k], customised, glob[k])
            models[upload["client_id"]] = combined
        info: dict[str, Any] = {"fedcac_threshold": threshold, "fedcac_collaborators": sum(sizes) / n}
        return {**server, "models": models, ROUND_INFO: info}


def sum_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    """t_0 + t_1 + ... added left to right (the authors' order: the client's own model first)."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


FedCAC.card = MethodCard(
    full_name="FedCAC",
    paper=Paper(
        "Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through Cautiously "
        "Aggressive Collaboration",
        "Wu et al.",
        2023,
        "ICCV",
        "https://arxiv.org/abs/2309.11103",
    ),
    personalised=True,
    shares="Its trained model, its training-set size and the mask of its critical parameters.",
    keeps="Nothing between rounds: the server keeps each client's next model.",
    scored="the received combination",
    scored_detail="The client's customised model at its critical parameters, the global model elsewhere.",
    client_round="Overwrite the local model with the received one (round 1: the global model). Train E epochs "
    "of SGD. In every parameter tensor mark as critical the top τ fraction (τ = 0.5) of |(θ − θ₀) ⊙ θ|, θ₀ the "
    "received model. Upload the model and the mask. The server averages the models as FedAvg and builds each "
    "client's customised model from the clients whose masks overlap with its own at least as much as the "
    "round's threshold, which rises from the mean overlap towards the largest by t/β (β = 100).",
    references=(
        Reference(
            "FLAIR-Community/Fling",
            "faebd06",
            (
                "fling/component/client/fedcac_client.py",
                "fling/component/group/fedcac_group.py",
                "fling/utils/compress_utils/fed_avg.py",
                "flzoo/cifar10/cifar10_fedcac_resnet_config.py",
            ),
        ),
        Reference("TsingZ0/PFLlib", "d832e76", ("clients/clientcac.py", "servers/servercac.py")),
    ),
    tests=(
        "tests/methods/test_fedcac.py::test_fedcac_rounds_match_the_authors_group",
        "tests/methods/test_fedcac.py::test_critical_mask_by_hand",
        "tests/methods/test_fedcac.py::test_overlap_and_threshold_by_hand",
    ),
    differences=(
        "The authors' group aggregates every client in every round; pflkit refuses a join ratio below 1. "
        "PFLlib builds the customised models from the round's sampled clients only.",
        "A client without critical parameters overlaps no one (0); the authors' overlap divides by zero there.",
        "The authors train with SGD momentum 0.9 (lr 0.1, batch 100, 5 local epochs); pflkit uses the run's "
        "optimiser settings.",
    ),
    choices=(
        Choice("τ (the authors' configs: 0.5 on CIFAR-10, 0.4 on CIFAR-100)", "0.5", "`fedcac.tau`"),
        Choice("β (the authors' configs: 100 on CIFAR-10, 170 on CIFAR-100)", "100", "`fedcac.beta`"),
    ),
    notes=(
        "The round's record holds `fedcac_threshold` and `fedcac_collaborators`, the mean number of "
        "clients (the client itself included) behind a customised model.",
        "With bn_buffers = local, batch-norm running statistics never leave the client, as in the authors' code.",
        "The server keeps every client's next model: checkpoints carry it and a resumed run continues it.",
        "The critical mask is a threshold: where two engines' numbers differ in the last bits (batch norm on "
        "vmap), an entry at a near-tie may fall on either side, and the runs drift apart from there.",
    ),
    ala_initialises="the local model, blending in the received combination",
)

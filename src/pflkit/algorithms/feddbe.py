"""FedDBE (Zhang et al., NeurIPS 2023): FedAvg with domain bias eliminated in representation space.

Each client keeps a personal representation bias c, a vector added to the body's output before
the head (a module between body and head, ``pflkit.models.between``): logits = head(h + c). Per
batch the client updates a running mean of the features, m <- (1 - momentum) m + momentum mean(h)
(reset every round, gradient through this batch's mean), and minimises
CE(head(h + c), y) + kappa * mean(0.5 (m - m_g)^2), m_g the global mean; the model steps with the
run's optimiser, c with plain SGD at the lr. The server averages the models as FedAvg.

The first round is the authors' initialisation pass: the clients train on plain cross-entropy
(no c, no regulariser) only to measure m, the server sets m_g to the sample-weighted mean of the
uploaded m and keeps the global model as it was (the pass's models are discarded); m_g stays
fixed afterwards. Scored model: the received global with the client's c.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from ..functional import Params, WeightedSum, clone
from ..functional.training import Batch, CarryLossFn, Net, cross_entropy
from ..models import head_names
from ..models.between import Between, Head, register_between, without_between
from .base import (
    Aggregator,
    Algorithm,
    ClientContext,
    Payload,
    SentUpload,
    Settings,
    State,
    Trained,
    WeightedAverage,
)
from .card import Choice, MethodCard, Paper, Reference
from .context import TrainBatches
from .registry import register

MEAN = "feddbe.global_mean"  # m_g in the server state and the payload
RUNNING = "feddbe.running_mean"  # m among the tensors a fit carries


class FedDBESettings(Settings):
    kappa: float = Field(
        50.0, ge=0, description="κ, the weight of the mean regulariser (the authors' script: 50; PFLlib's default 0)"
    )
    momentum: float = Field(
        1.0,
        gt=0,
        le=1,
        description="momentum of the running feature mean (the authors' script: 1, the batch's mean; PFLlib's 0.1)",
    )


class RepresentationBias(Between):
    """FedDBE's personal representation bias: head(h + c), c kept on the client."""

    kind = "dbe"
    shared = frozenset()

    def route(self, params: Any, h: torch.Tensor, head: Head) -> torch.Tensor:
        return head(params, h + params[self.name("bias")])


BIAS = register_between(RepresentationBias())


def batch_feature_mean(h: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The mean of the batch's features over its real samples."""
    if batch.mask is None:
        return h.mean(0)
    mask = batch.mask.reshape(-1, *[1] * (h.dim() - 1)).to(h.dtype)
    return (h * mask).sum(0) / mask.sum()


def dbe_loss(body: int, momentum: float, kappa: float, warmup: bool) -> CarryLossFn:
    """CE(head(h + c)) + κ mean(0.5 (m - m_g)^2), updating m; ``warmup``: CE(head(h)) alone."""

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> tuple[torch.Tensor, Params]:
        h = net(params, batch.x, stop=body)
        running = (1 - momentum) * params[RUNNING] + momentum * batch_feature_mean(h, batch)
        if warmup:
            return cross_entropy(net(without_between(params), h, start=body), batch), {RUNNING: running}
        value = cross_entropy(net(params, h, start=body), batch)  # routed through head(h + c)
        regulariser = torch.mean(0.5 * (running - aux["mean"]) ** 2)
        return value + kappa * regulariser, {RUNNING: running}

    return loss


@register
class FedDBE(Algorithm):
    name = "feddbe"
    settings_class = FedDBESettings
    settings: FedDBESettings

    body_use = "adds a vector between the model's body and its head"

    def __init__(self, settings: Any, train: Any, units: Any) -> None:
        super().__init__(settings, train, units)
        self.head = head_names(units)
        self.body = len(units) - 1

    def check_model(self, model: torch.nn.Module) -> None:
        if not getattr(model, "linear_head", False):
            raise ValueError(
                f"{self.name} adds a vector to the features a linear head reads, and {type(model).__name__}'s "
                "head is no linear layer: choose a model with a linear head (digits_cnn, fedavg_cnn, resnet18, ...)"
            )

    def _zeros(self, params: Params) -> torch.Tensor:
        return torch.zeros_like(params[self.head[0]][0])  # one feature vector: a row of the head's weight

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        payload = super().downlink(server, client_id, round)
        return {**payload, MEAN: server[MEAN]} if MEAN in server else payload

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": clone(init_params), "between": {BIAS.name("bias"): self._zeros(init_params)}}

    def eval_params(self, state: State) -> Params:
        return {**state["model"], **state["between"]}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        cfg, warmup = self.settings, MEAN not in payload
        bias = BIAS.name("bias")
        fit = ctx.fit(
            {**state["model"], **state["between"], RUNNING: torch.zeros_like(state["between"][bias])},
            dbe_loss(self.body, cfg.momentum, 0.0 if warmup else cfg.kappa, warmup),
            aux=None if warmup else {"mean": payload[MEAN]},
            trainable=self.parameter_names + ([] if warmup else [bias]),
            optimizer=ctx.train.optimizer(plain=[bias]),  # c: its own plain SGD at the lr (the authors')
            data=TrainBatches("train", self.train.local_epochs),
            carry=[RUNNING],
        )
        model = {k: fit.params[k] for k in state["model"]}
        new = {**state, "model": model, "between": {bias: fit.params[bias]}}
        extra = {"running_mean": fit.params[RUNNING]} if warmup else {}
        return new, self.upload(model, ctx, **extra), {"train_loss": fit.loss}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        """The first round sets m_g (the sample-weighted mean of the clients' m) and keeps the global
        model; every later round is FedAvg's average."""
        return self.fold(server, uploads, round)

    def aggregator(self, server: State, round: int, total: float) -> Aggregator:
        return WeightedAverage(server, total) if MEAN in server else GlobalMean(server, total)


class GlobalMean:
    """FedDBE's first server step as an ``Aggregator``: m_g, the sample-weighted mean of the
    clients' running feature means; the global model stays as it was."""

    def __init__(self, server: State, total: float) -> None:
        self.server = server
        self.sum = WeightedSum(total)

    def add(self, upload: SentUpload) -> None:
        # the ignore: running_mean is FedDBE's own upload entry
        self.sum.add({MEAN: upload["running_mean"]}, upload["num_samples"])  # type: ignore[typeddict-item]

    def result(self) -> State:
        return {**self.server, **self.sum.result()}


FedDBE.card = MethodCard(
    full_name="FedDBE",
    paper=Paper(
        "Eliminating Domain Bias for Federated Learning in Representation Space",
        "Zhang et al.",
        2023,
        "NeurIPS",
        "https://arxiv.org/abs/2311.14975",
    ),
    personalised=True,
    shares="The whole model and its training-set size (in the first round, the running feature mean instead of "
    "a model the server keeps); the server averages the models as FedAvg.",
    keeps="The personal representation bias c, a vector added to the body's output.",
    scored="the received global with head(h + c)",
    client_round="Overwrite the model with the received global. Train E epochs of SGD on CE(head(h + c)) + "
    "κ mean(0.5 (m − m_g)²) (κ = 50), m the running mean of the batches' features (momentum 1: the batch's "
    "mean), m_g the global mean; c steps by plain SGD at the lr. Upload the model. In the first round the "
    "clients train on plain CE only to measure m; the server sets m_g to their sample-weighted mean and "
    "keeps its model.",
    references=(
        Reference(
            "TsingZ0/DBE",
            "193f435",
            (
                "system/flcore/clients/clientDBE.py (train, test_metrics)",
                "system/flcore/servers/serverDBE.py (the initialisation period)",
                "system/main.py, system/run_me.sh (-mo 1 -klw 50)",
            ),
        ),
        Reference(
            "TsingZ0/PFLlib", "d832e76", ("system/flcore/clients/clientdbe.py", "system/flcore/servers/serverdbe.py")
        ),
    ),
    tests=(
        "tests/methods/test_feddbe.py::test_feddbe_client_is_the_authors_train",
        "tests/methods/test_feddbe.py::test_feddbe_first_round_is_the_authors_initialisation_pass",
        "tests/methods/test_feddbe.py::test_feddbe_scores_the_head_on_features_plus_the_personal_bias",
    ),
    differences=(
        "The authors' initialisation pass runs on every client before the first round; pflkit's first round "
        "is that pass, on the round's clients, so m_g comes from them and the first round leaves the global "
        "model as it was.",
        "c lives between the body and the head (`between.dbe.bias`); a model whose head is no linear layer "
        "(squeezenet1_1) is refused.",
    ),
    choices=(
        Choice("κ (PFLlib's default: 0)", "50, the authors' script", "`feddbe.kappa`"),
        Choice("momentum of the running mean (PFLlib's default: 0.1)", "1, the authors' script", "`feddbe.momentum`"),
    ),
    notes=(
        "`train_loss` includes κ times the regulariser.",
        "c is client state and m_g server state: checkpoints carry both and a resumed run continues them.",
    ),
    ala_initialises="the local model; ALA's weight learning runs the model without c",
)

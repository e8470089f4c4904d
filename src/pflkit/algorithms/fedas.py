"""FedAS (Yang et al., CVPR 2024): federated parameter alignment and client synchronisation.

The head stays on the client (``personal_part = "head"``). Parameter alignment: before training,
the client computes the mean body output of each of its classes with its previous local model
(its class prototypes), then trains the received body for one epoch of plain SGD (lr 0.01,
batches of 16) on sum over the batch's classes c of MSE(body(x_c), prototype_c), and takes the
aligned body. The client trains for E epochs, then computes the trace of the Fisher information
of its trained model, sum over its training batches of ||grad NLL||^2 (evaluation mode, every
parameter), and uploads its body with it. Client synchronisation: the server averages the bodies
weighted by the uploads' Fisher traces. Scored model: the aligned body with the client's head.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field

from ..functional import SGD, Params, WeightedSum, clone
from ..functional.training import Batch, GradFn, LossFn, Net, cross_entropy, one_hot
from .base import (
    Aggregator,
    Algorithm,
    ClientContext,
    Init,
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

FISHER = "fedas.fisher"  # the Fisher trace a fit accumulates next to the model's parameters
PROTOTYPES = "prototypes"


class FedASSettings(Settings):
    align: bool = Field(True, description="parameter alignment; False: take the received body as it is (wo_local)")
    align_lr: float = Field(0.01, gt=0, description="learning rate of the alignment's plain SGD (the authors': 0.01)")
    align_batch_size: int = Field(16, ge=1, description="batch size of the alignment (the authors': 16)")
    align_epochs: int = Field(1, ge=1, description="epochs of alignment (the authors': 1)")
    fisher_weights: bool = Field(
        True, description="weight the server's average by the uploads' Fisher traces; False: FedAvg (wo_global)"
    )


def body_output(body: int) -> Any:
    """The per-sample map of ``class_sums``: the body's flattened output (evaluation mode)."""

    def fn(net: Net, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return net(params, x, stop=body, train=False).flatten(1)

    return fn


def alignment_loss(body: int) -> LossFn:
    """sum over the classes c in the batch of mean((body(x_i) - p_c)^2) over its samples i of class c
    and the output's entries (``torch.nn.MSELoss`` per class); ``aux[PROTOTYPES]``: [C, d]."""

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        z = net(params, batch.x, stop=body, train=False).flatten(1)
        prototypes = aux[PROTOTYPES]
        onehot = one_hot(batch.y, prototypes.shape[0], z.dtype)
        if batch.mask is not None:
            onehot = onehot * batch.mask[:, None]
        per_class = onehot.sum(0)  # samples of each class in the batch
        squared = ((z - onehot @ prototypes) ** 2).sum(1)
        share = (onehot / (per_class * z.shape[1]).clamp(min=1)).sum(1)  # 1 / (n_c d) for sample i of class c
        return (squared * share).sum()

    return loss


def fisher_step(net: Net, names: list[str]) -> Any:
    """A ``fit`` step that leaves the model as it is and adds sum_k ||grad_k NLL||^2 over the
    parameters ``names`` (evaluation-mode forward, mean NLL over the batch) to ``FISHER``."""

    def step(value_and_grad: Any, trainable: Params, frozen: Params, batch: Batch, aux: Any) -> tuple[Params, Any]:
        def nll(model: Params, fixed: Params, b: Batch) -> torch.Tensor:
            return cross_entropy(net({**fixed, **model}, b.x, train=False), b)

        grad_fn: GradFn = value_and_grad(nll)
        grads, value = grad_fn({k: trainable[k] for k in names}, frozen, batch)
        trace = sum((g**2).sum() for g in grads.values())
        return {**trainable, FISHER: trainable[FISHER] + trace}, value

    return step


@register
class FedAS(Algorithm):
    name = "fedas"
    settings_class = FedASSettings
    settings: FedASSettings
    personal_part = "head"
    has_global_model = False  # the server never trains a head
    ala_targets = {}
    ala_refusal = "parameter alignment is FedAS's own way of taking in the received body, and ALA would replace it"

    @property
    def body(self) -> int:
        return len(self.units) - 1

    def smallest_full_client(self) -> int:
        """The alignment's batches too must be full."""
        return max(self.train.batch_size, self.settings.align_batch_size)

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        local, received = state["model"], payload["global"]
        if not self.settings.align:
            return {**state, "model": {**local, **clone(received)}}, {}
        counts = ctx.label_counts
        sums = ctx.class_sums(local, body_output(self.body))
        prototypes = sums / counts.clamp(min=1).to(sums.dtype)[..., None]
        cfg = self.settings
        names = [k for k in self.parameter_names if k in received]
        fit = ctx.fit(
            {**local, **received},
            alignment_loss(self.body),
            trainable=names,
            aux={PROTOTYPES: prototypes},
            data=_batches("fedas/align", cfg.align_epochs, cfg.align_batch_size),
            optimizer=SGD(cfg.align_lr),
            stage="parameter alignment",
        )
        aligned = {k: fit.params[k] for k in received}
        return {**state, "model": {**local, **aligned}}, {"align_loss": fit.loss}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        fit = self.train_model(state["model"], ctx, self.loss())
        fisher = self.fisher_trace(fit.params, ctx)
        upload = self.upload(self.shared(fit.params), ctx, fisher=fisher)
        return {**state, "model": fit.params}, upload, {"train_loss": fit.loss, "fisher": fisher}

    def fisher_trace(self, params: Params, ctx: ClientContext) -> torch.Tensor:
        """sum over one pass of the client's training batches of ||grad NLL||^2 at ``params``."""
        start = torch.zeros(ctx.client_shape, device=next(iter(params.values())).device)
        fit = ctx.fit(
            {**params, FISHER: start},
            step=fisher_step(ctx.net, self.parameter_names),
            trainable=[*self.parameter_names, FISHER],
            data=_batches("fedas/fisher", 1, None),
            stage="Fisher information",
        )
        return fit.params[FISHER].detach()

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        return self.fold(server, uploads, round)

    def aggregator(self, server: State, round: int, total: float) -> Aggregator:
        return FisherAverage(server, total) if self.settings.fisher_weights else WeightedAverage(server, total)


class FisherAverage:
    """FedAS's server rule as an ``Aggregator``: the uploads' bodies averaged with weights their
    Fisher traces; where every trace is 0 (no gradient anywhere), the sample-weighted average. The
    traces' total is known only once every upload is in, so the sum is divided at the end."""

    def __init__(self, server: State, total: float) -> None:
        self.server = server
        self.by_fisher = WeightedSum()
        self.by_samples = WeightedAverage(server, total)

    def add(self, upload: SentUpload) -> None:
        trace = float(upload["fisher"])  # type: ignore[typeddict-item]  # FedAS's own upload entry
        if not math.isfinite(trace) or trace < 0:
            raise ValueError(f"fedas: client {upload['client_id']} uploaded the Fisher trace {trace}")
        self.by_fisher.add(upload["params"], trace)
        self.by_samples.add(upload)

    def result(self) -> State:
        if not self.by_fisher.added > 0:
            return self.by_samples.result()
        return {**self.server, "global": {**self.server["global"], **self.by_fisher.result()}}


def _batches(purpose: str, epochs: int, batch_size: int | None) -> TrainBatches:
    return TrainBatches(purpose, epochs, batch_size, mixup=False)


FedAS.card = MethodCard(
    full_name="FedAS",
    paper=Paper(
        "FedAS: Bridging Inconsistency in Personalized Federated Learning",
        "Yang et al.",
        2024,
        "CVPR",
        "https://openaccess.thecvf.com/content/CVPR2024/html/Yang_FedAS_Bridging_Inconsistency_in_Personalized_"
        "Federated_Learning_CVPR_2024_paper.html",
    ),
    personalised=True,
    shares="Its body, its training-set size and the trace of its Fisher information; the server averages the "
    "bodies weighted by the traces.",
    keeps="Its head, and its model of the last round, whose class prototypes the alignment targets.",
    scored="the aligned body with the local head",
    client_round="Compute the mean body output of each class (the prototypes) with the local model. Align the "
    "received body for one epoch of plain SGD (lr 0.01, batches of 16) on the sum over each batch's classes "
    "of the MSE between the body's outputs and the class prototype; replace the local body with it. Train the "
    "whole model E epochs of SGD. Compute the Fisher trace, the sum over the training batches of the squared "
    "gradient norm of the NLL (evaluation mode). Upload the body and the trace.",
    references=(
        Reference(
            "xiyuanyang45/FedAS",
            "1a4f5fd",
            (
                "system/flcore/clients/clientas.py",
                "system/flcore/servers/serveras.py",
                "system/flcore/clients/clientbase.py",
                "system/examples.sh",
            ),
        ),
        Reference("TsingZ0/PFLlib", "d832e76", ("clients/clientas.py", "servers/serveras.py")),
    ),
    tests=(
        "tests/methods/test_fedas.py::test_fedas_client_matches_the_authors_clientas",
        "tests/methods/test_fedas.py::test_fedas_server_weights_the_bodies_by_fisher_traces",
        "tests/methods/test_fedas.py::test_fedas_without_alignment_takes_the_received_body",
    ),
    pinned=("tests/methods/test_fedas.py::test_fedas_authors_shared_global_alignment",),
    differences=(
        "The authors' server aligns one shared global model, client after client, so each client aligns "
        "the body the previous one aligned; PFLlib aligns a copy per client. pflkit aligns the received body "
        "per client (PFLlib, the paper).",
        "The authors' clients average the body outputs over full batches of 16 (the last partial batch "
        "left out); pflkit's prototypes average over every training sample.",
        "The authors' data loaders do not shuffle; pflkit reshuffles the batches of each pass.",
        "The authors' server averages whole models, heads included, but clients only take the body; pflkit "
        "uploads the body alone.",
        "The authors' clients score their trained model at the start of the next round; pflkit scores "
        "the aligned body with the local head.",
        "If every upload's Fisher trace is 0, the server averages by training-set size; the authors' "
        "weights divide by zero there.",
        "Batch norm: pflkit aligns in evaluation mode with the client's own running statistics (the download "
        "carries none by default). The authors' server model is a copy of the lowest-numbered uploader's, left "
        "in evaluation mode by its Fisher pass, so from round 2 their clients align with that client's "
        "statistics (in round 1, in training mode). The two differ only on models with batch norm or dropout.",
    ),
    choices=(
        Choice("parameter alignment", "on", "`fedas.align = false` (the authors' wo_local)"),
        Choice("Fisher-weighted aggregation", "on", "`fedas.fisher_weights = false` (the authors' wo_global)"),
        Choice(
            "alignment's learning rate, batch size and epochs",
            "0.01, 16, 1",
            "`fedas.align_lr`, `fedas.align_batch_size`, `fedas.align_epochs`",
        ),
    ),
    notes=(
        "`align_loss` is the alignment's mean step loss; `fisher` the mean Fisher trace of the round's clients.",
        "The local model is client state: checkpoints carry it and a resumed run continues it.",
        "`+ala` is not offered: parameter alignment is FedAS's own way of taking in the received body, and "
        "ALA would replace it.",
    ),
    step_function=True,  # the Fisher pass: a step that only accumulates squared gradients
)

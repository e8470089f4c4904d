"""FedProto (Tan et al., AAAI 2022): clients share class prototypes, never model parameters.

Every client keeps its whole model. A round: train it for E epochs on CE + λ · MSE(z, p_y), z the
body's output (every unit but the last, flattened) and p_y the global prototype of the sample's
class (no term for a class without one; round 1 has none); the prototypes it uploads are its
per-class means of z (a class it does not hold is not uploaded). The server's prototype of a class
is the plain mean over the clients that uploaded that class, whatever their sizes. Scored: the
nearest global prototype (by squared distance) among the client's own classes that have one, as a
linear head 2 p_c·z/d − ‖p_c‖²/d (a class out of the candidates gets the logit ``MISSING``); or
the local head (``scoring = "head"``).

As the authors' code (yuetan031/FedProto, commit 97e42e2, ``lib/update.py`` ``update_weights_het``,
``lib/utils.py`` ``agg_func``, ``proto_aggregation``): the client's prototypes are the features of
its last local epoch's training batches, taken in training mode by the forward of each step.
PFLlib's ``clientproto.py`` takes them over every epoch and scores against every class's prototype
(``prototypes = "all_epochs"``, ``candidates = "all"``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from ..functional import Params, clone
from ..functional.training import Batch, LossFn, Net, cross_entropy, label_loss, one_hot
from ..models import head_names
from .base import Algorithm, ClientContext, Init, Payload, SentUpload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .context import TrainBatches
from .registry import register

#: the logit of a class out of the nearest-prototype candidates
MISSING = -1.0e4
SUMS, COUNTS = "fedproto.sums", "fedproto.counts"  # this epoch's feature sums per class
LAST_SUMS, LAST_COUNTS = "fedproto.last_sums", "fedproto.last_counts"  # the last finished epoch's


class FedProtoSettings(Settings):
    lam: float = Field(
        1.0, ge=0, description="λ, the weight of the prototype distance (the authors' ld: 1; their CIFAR-10: 0.1)"
    )
    scoring: Literal["prototype", "head"] = Field(
        "prototype",
        description="the scored prediction: the nearest global prototype (the authors' and PFLlib's) or the local head",
    )
    candidates: Literal["own", "all"] = Field(
        "own",
        description="classes the nearest-prototype rule chooses among: the client's own classes that "
        "have a global prototype (the authors') or every class that has one (PFLlib)",
    )
    prototypes: Literal["last_epoch", "all_epochs", "after_training"] = Field(
        "last_epoch",
        description="the features a client's prototypes average: its last local epoch's training "
        "batches (the authors'), every epoch's (PFLlib), or every training sample in evaluation "
        "mode after training",
    )


def body_features(net: Net, params: Params, x: torch.Tensor, body: int, train: bool = True) -> torch.Tensor:
    return net(params, x, stop=body, train=train).flatten(1)


def prototype_distance(z: torch.Tensor, batch: Batch, prototypes: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of the per-sample MSE(z, p_y), zero where class y has no prototype."""

    def per_sample(y: torch.Tensor) -> torch.Tensor:
        target = prototypes.index_select(0, y)
        return known.index_select(0, y) * ((z - target) ** 2).mean(-1)

    return label_loss(per_sample, batch)


def fedproto_loss(lam: float, body: int, num_classes: int) -> LossFn:
    """CE + λ · MSE(z, p_y); carries the per-class sums and counts of the batch's features
    (``aux``: the global ``prototypes`` [C, d] and ``known`` [C], 1 where a class has one)."""

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> Any:
        z = body_features(net, params, batch.x, body)
        ce = cross_entropy(net(params, z, start=body), batch)
        value = ce + lam * prototype_distance(z, batch, aux["prototypes"], aux["known"]) if lam else ce
        weights = one_hot(batch.y, num_classes, z.dtype)
        if batch.lam is not None:  # a mixed sample counts for both labels
            assert batch.y_mix is not None
            weights = batch.lam * weights + (1 - batch.lam) * one_hot(batch.y_mix, num_classes, z.dtype)
        if batch.mask is not None:
            weights = weights * batch.mask[:, None]
        detached = z.detach()
        return value, {
            **{k: params[k] for k in (LAST_SUMS, LAST_COUNTS)},
            SUMS: params[SUMS] + weights.t() @ detached,
            COUNTS: params[COUNTS] + weights.sum(0),
        }

    return loss


def keep_last_epoch(carried: Params) -> Params:
    """End of epoch: the epoch's sums become the last epoch's; the running sums restart. (Copies:
    a batched context writes the results back in place, one entry after another.)"""
    return {
        LAST_SUMS: carried[SUMS].clone(),
        LAST_COUNTS: carried[COUNTS].clone(),
        SUMS: torch.zeros_like(carried[SUMS]),
        COUNTS: torch.zeros_like(carried[COUNTS]),
    }


def class_means(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-class means [.., C, d] of feature sums; zero for a class without samples."""
    return sums / counts.clamp(min=1)[..., None]


class HolderMean:
    """FedProto's server rule as an ``Aggregator``: per class, the plain mean of the uploaded class
    means over the clients that hold the class (``class_counts`` > 0); ``known`` marks the classes
    some client holds (1.0 / 0.0). Uploads are folded in one at a time."""

    def __init__(self, server: State) -> None:
        self.server = server
        self.sums: torch.Tensor | None = None
        self.held: torch.Tensor | None = None

    def add(self, upload: SentUpload) -> None:
        # the ignores: class_means and class_counts are FedProto's own upload entries
        means: torch.Tensor = upload["class_means"]  # type: ignore[typeddict-item]
        holders = (upload["class_counts"] > 0).to(means.dtype)  # type: ignore[typeddict-item]
        if self.sums is None or self.held is None:
            self.sums, self.held = torch.zeros_like(means), torch.zeros_like(holders)
        self.sums.add_(holders[:, None] * means)
        self.held.add_(holders)

    def result(self) -> State:
        if self.sums is None or self.held is None:
            return self.server
        prototypes = self.sums / self.held.clamp(min=1)[:, None]
        return {**self.server, "prototypes": prototypes, "known": (self.held > 0).to(self.sums.dtype)}


def nearest_prototype_head(
    prototypes: torch.Tensor, candidates: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of the linear head whose argmax is the nearest candidate prototype:
    (2 p_c·z − ‖p_c‖²)/d = (‖z‖² − ‖z − p_c‖²)/d, the same order as −MSE(z, p_c)."""
    d = prototypes.shape[-1]
    weight = torch.where(candidates[..., None] > 0, 2 * prototypes / d, torch.zeros_like(prototypes))
    bias = torch.where(candidates > 0, -(prototypes**2).sum(-1) / d, torch.full_like(candidates, MISSING))
    return weight.to(dtype), bias.to(dtype)


def linear_head(units: Any, method: str, scoring: str) -> tuple[str, str | None]:
    head = head_names(units)
    if len(head) > 2:
        raise ValueError(f"{method} needs a linear head (a weight and a bias); the model's last unit has {head}")
    if scoring == "prototype" and len(head) < 2:
        raise ValueError(
            f"{method} scores the nearest prototype as a linear head with a bias, and this model's head "
            f'{head[0]!r} has none: set {method}.scoring = "head" or choose a model whose head has a bias'
        )
    return head[0], head[1] if len(head) > 1 else None


@register
class FedProto(Algorithm):
    name = "fedproto"
    settings_class = FedProtoSettings
    settings: FedProtoSettings
    has_global_model = False  # the server holds prototypes, no model
    ala_targets = {}  # nothing but prototypes is downloaded: there is no model for ALA to blend

    body_use = "averages the features of the model's body (every unit but the head)"

    def __init__(self, settings: Any, train: Any, units: Any) -> None:
        super().__init__(settings, train, units)
        self.weight, self.bias = linear_head(units, "fedproto", self.settings.scoring)
        self.body = len(units) - 1

    def init_server(self, init_params: Params) -> State:
        weight = init_params[self.weight]
        if weight.dim() != 2:
            raise ValueError(f"fedproto needs a linear head: {self.weight!r} has shape {tuple(weight.shape)}")
        C, d = weight.shape
        return {
            "global": clone(init_params),
            "prototypes": torch.zeros(C, d, dtype=weight.dtype, device=weight.device),
            "known": torch.zeros(C, dtype=weight.dtype, device=weight.device),
        }

    def init_client(self, init_params: Params, client_id: int) -> State:
        C, d = init_params[self.weight].shape
        like = init_params[self.weight]
        return {"model": clone(init_params), "prototypes": like.new_zeros(C, d), "candidates": like.new_zeros(C)}

    def downloaded_names(self, names: list[str]) -> list[str]:
        return []

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        return {"prototypes": server["prototypes"], "known": server["known"]}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        candidates = payload["known"].clone()
        if self.settings.candidates == "own":
            candidates = candidates * (ctx.label_counts > 0).to(candidates.dtype)
        return {**state, "prototypes": payload["prototypes"].clone(), "candidates": candidates}, {}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        cfg = self.settings
        model = state["model"]
        C, d = payload["prototypes"].shape[-2:]
        zeros = torch.zeros(*ctx.client_shape, C, d, dtype=payload["prototypes"].dtype)
        zeros = zeros.to(payload["prototypes"].device)
        counts = zeros[..., 0]
        carried = {SUMS: zeros, COUNTS: counts, LAST_SUMS: zeros.clone(), LAST_COUNTS: counts.clone()}
        fit = ctx.fit(
            {**model, **carried},
            fedproto_loss(cfg.lam, self.body, C),
            aux={"prototypes": payload["prototypes"], "known": payload["known"]},
            data=TrainBatches("train", self.train.local_epochs),
            trainable=self.parameter_names,
            carry=list(carried),
            epoch_end=keep_last_epoch if cfg.prototypes == "last_epoch" else None,
        )
        trained = {k: fit.params[k] for k in model}
        if cfg.prototypes == "after_training":
            sums = ctx.class_sums(trained, lambda net, p, x, y: body_features(net, p, x, self.body, train=False))
            seen = ctx.label_counts.to(sums.dtype)
        elif cfg.prototypes == "last_epoch":
            sums, seen = fit.params[LAST_SUMS], fit.params[LAST_COUNTS]
        else:
            sums, seen = fit.params[SUMS], fit.params[COUNTS]
        upload = self.upload({}, ctx, class_means=class_means(sums, seen), class_counts=seen)
        return {**state, "model": trained}, upload, {"train_loss": fit.loss}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        return self.fold(server, uploads, round) if uploads else server

    def aggregator(self, server: State, round: int, total: float) -> HolderMean:
        return HolderMean(server)

    def eval_params(self, state: State) -> Params:
        model = state["model"]
        if self.settings.scoring == "head":
            return model
        assert self.bias is not None  # (refused in __init__)
        weight, bias = nearest_prototype_head(state["prototypes"], state["candidates"], model[self.weight].dtype)
        return {**model, self.weight: weight, self.bias: bias}


FedProto.card = MethodCard(
    full_name="FedProto",
    paper=Paper(
        "FedProto: Federated Prototype Learning across Heterogeneous Clients",
        "Tan et al.",
        2022,
        "AAAI",
        "https://arxiv.org/abs/2105.00243",
    ),
    personalised=True,
    shares="Per class it holds, the mean of its body's features (its prototype), with its class counts; "
    "never a model parameter.",
    keeps="Its whole model, and the global prototypes it received.",
    scored="the nearest global prototype among the own classes",
    scored_detail="The client's body maps a test sample to z; the prediction is the class whose global "
    "prototype is nearest to z (squared distance), among the client's own classes that have one. "
    '`fedproto.scoring = "head"` scores the local head instead.',
    client_round="Keep the local model. Train it for E epochs on CE + λ·MSE(z, p_y) (λ = 1), z the body's "
    "features and p_y the received global prototype of the sample's class (no term where the class has "
    "none; round 1 has none). Upload, per class, the mean of z over the last epoch's training batches. "
    "The server's prototype of a class is the plain mean over the clients that uploaded it.",
    references=(
        Reference(
            "yuetan031/FedProto",
            "97e42e2",
            (
                "lib/update.py (LocalUpdate.update_weights_het, test_inference_new_het_lt)",
                "lib/utils.py (agg_func, proto_aggregation)",
                "exps/federated_main.py (FedProto_taskheter)",
            ),
        ),
        Reference(
            "TsingZ0/PFLlib",
            "d832e76",
            ("system/flcore/clients/clientproto.py", "system/flcore/servers/serverproto.py"),
        ),
    ),
    tests=(
        "tests/methods/test_fedproto.py::test_fedproto_client_round_is_the_authors_update_weights_het",
        "tests/methods/test_fedproto.py::test_fedproto_server_is_the_authors_proto_aggregation_over_holders_only",
        "tests/methods/test_fedproto.py::test_fedproto_scores_the_authors_nearest_prototype_among_own_classes",
        "tests/methods/test_fedproto.py::test_fedproto_all_epochs_prototypes_are_pfllibs_clientproto",
    ),
    differences=(
        "The authors score once after the last round; pflkit scores every evaluation round. Before the "
        "first aggregation no class has a prototype, and every class gets the same logit.",
        "The authors' `test_inference_new_het_lt` never resets its counts between clients or between its two "
        "passes, so each reported accuracy is a running ratio over the clients before it, the local head's "
        "pass included; pflkit scores each client on its own test split. Compare with the paper's numbers "
        "with that in mind.",
        "A class out of the candidates gets the logit −10⁴; the authors give it the distance 100, PFLlib an "
        "infinite one.",
        "The authors train with SGD momentum 0.5, lr 0.01 and batch 4; pflkit uses the run's optimiser settings.",
        "Under partial participation the server's prototypes are those of the round's uploads, as PFLlib's "
        "(the authors' clients all take part every round).",
    ),
    choices=(
        Choice("λ (the authors' MNIST and FEMNIST: 1; CIFAR-10: 0.1)", "1", "`fedproto.lam`"),
        Choice(
            "the scored prediction",
            "the nearest global prototype among the client's own classes (the authors')",
            '`fedproto.scoring = "head"` (the local head), `fedproto.candidates = "all"` (every class with a '
            "prototype, PFLlib's)",
        ),
        Choice(
            "the features a prototype averages",
            "the last local epoch's training batches, training mode (the authors')",
            '`fedproto.prototypes = "all_epochs"` (PFLlib), `"after_training"` (evaluation mode, every sample)',
        ),
    ),
    notes=(
        "Nothing but prototypes is downloaded, so `fedproto+ala` has no model to blend and is refused.",
        "`train_loss` includes λ·MSE.",
    ),
)

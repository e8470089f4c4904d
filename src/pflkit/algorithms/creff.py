"""CReFF (Shang et al., IJCAI 2022): classifier re-training with federated features for
heterogeneous and long-tailed data, as the authors' code runs it
(shangxinyi/CReFF-FL, commit fbec98f, ``main.py`` and ``Dataset/Gradient_matching_loss.py``).

The server keeps, beside the FedAvg model, ``features`` learnable federated features per class
(N(0, 1) at the start, kept across rounds) and the classifier it re-trained last round (round 1:
a freshly initialised linear layer). Each round:

1. every client first computes, per class it holds, the mean cross-entropy gradient of that
   re-trained classifier (weight and bias) on its real features under the received body (closed
   form: (softmax - onehot) x h), then trains as in FedAvg from the received model;
2. the server averages the models (sample-weighted, as the original code) and the gradients of
   each class over the clients that hold it (a plain mean);
3. for ``match_steps`` steps it moves the federated features (SGD, ``feature_lr``) so that the
   same classifier's gradient on each class's features matches that class's aggregated gradient:
   the loss sums over the classes the cosine distances of the weight gradient's rows (one per
   output class) plus one of the bias gradient, 1 - <a, b> / (|a| |b| + 1e-6);
4. a fresh linear classifier is trained on all federated features for ``retrain_epochs`` epochs of
   shuffled mini-batches of the run's batch size (SGD, ``retrain_lr``).

The re-trained classifier serves the global model's predictions and the next round's gradients;
clients keep receiving the averaged model unless ``send_retrained``. Remaining differences from
the authors' code: the client gradient is the exact mean over the class's samples (theirs: the
mean over 10 random sub-batches of 32, with differentiable augmentation; the same expectation,
equal when a class has at most 32 samples); FedNH's port of CReFF drops the bias and averages the
models uniformly.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, torch_generator, weighted_average
from ..functional.training import Net, one_hot
from ..models import head_names
from .base import Algorithm, ClientContext, ClientSummary, Payload, SentUpload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .registry import register

MATCHING_HEAD = "creff.head"  # the payload entry: the classifier the clients' gradients are taken at


class CReFFSettings(Settings):
    features: int = Field(100, ge=1, description="federated features per class (the authors' code: 100)")
    match_steps: int = Field(100, ge=0, description="gradient-matching steps per round (the authors' code: 100)")
    feature_lr: float = Field(
        0.1,
        gt=0,
        description="learning rate of the federated features (the authors' code: 0.1; FedNH's scripts pass 0.01)",
    )
    retrain_epochs: int = Field(
        300,
        ge=0,
        description="epochs of the fresh classifier's re-training on the federated features (the authors' code: 300)",
    )
    retrain_batch: int | None = Field(
        None, ge=1, description="re-training mini-batch (None: the run's batch_size, as the authors' code)"
    )
    retrain_lr: float = Field(0.01, gt=0, description="re-training learning rate (the authors' code: 0.01)")
    send_retrained: bool = Field(False, description="send the re-trained classifier to the clients too")


def head_gradients(weight: str, bias: str | None, body: int) -> Any:
    """Per sample, the cross-entropy gradient of a linear head: [(p - e_y) h^T, p - e_y] flattened
    (without the bias part for a head without bias)."""

    def fn(net: Net, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = net(params, x, stop=body, train=False).flatten(1)
        b = params[bias] if bias is not None else None
        err = torch.softmax(F.linear(h, params[weight], b), dim=-1) - one_hot(y, params[weight].shape[0])
        rows = (err[:, :, None] * h[:, None, :]).flatten(1)
        return torch.cat([rows, err], dim=1) if bias is not None else rows

    return fn


def classifier_gradient(
    features: torch.Tensor, label: int, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The mean cross-entropy gradient of the classifier (weight, bias) on ``features`` of one class,
    flattened as ``head_gradients`` (differentiable in ``features``)."""
    err = torch.softmax(F.linear(features, weight, bias), dim=-1) - one_hot(
        torch.full((len(features),), label, device=features.device), weight.shape[0]
    )
    rows = (err.t() @ features).flatten() / len(features)
    return torch.cat([rows, err.mean(0)]) if bias is not None else rows


def matching_distance(synthetic: torch.Tensor, real: torch.Tensor, classes: int, bias: bool = True) -> torch.Tensor:
    """The authors' 'ours' distance of two flattened classifier gradients [C*d + C]: the sum over
    the C rows of the weight gradient of 1 - cos, plus 1 - cos of the bias gradient, each cosine
    <a, b> / (|a| |b| + 1e-6). Without ``bias`` the gradients are [C*d], the rows only (FedNH's port)."""

    def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (1 - (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1) + 1e-6)).sum()

    d = (synthetic.numel() - (classes if bias else 0)) // classes
    rows = distance(synthetic[: classes * d].reshape(classes, d), real[: classes * d].reshape(classes, d))
    return rows + distance(synthetic[classes * d :], real[classes * d :]) if bias else rows


def fresh_linear(dim: int, classes: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``nn.Linear(dim, classes)``'s default initialisation, from ``generator``: U(-1/sqrt(d), 1/sqrt(d))."""
    bound = 1 / math.sqrt(dim)
    weight = (torch.rand(classes, dim, generator=generator) * 2 - 1) * bound
    bias = (torch.rand(classes, generator=generator) * 2 - 1) * bound
    return weight, bias


def retrain_classifier(
    features: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    epochs: int,
    batch: int,
    lr: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Train (``weight``, ``bias``; no bias: ``None``) on the federated features [C, m, d] (labels:
    their class) with plain SGD over ``epochs`` epochs of shuffled mini-batches (the last one smaller).

    A server-side loop by hand, not ``ctx.fit``: the server has no client context (no client data,
    streams or batching to share), and this is one classifier on in-memory features; the step is
    CReFF's code's plain ``w -= lr * g`` (no momentum, no weight decay, whatever the clients use)."""
    C, m, d = features.shape
    x = features.reshape(C * m, d)
    y = torch.arange(C, device=x.device).repeat_interleave(m)
    trained = [t.clone().requires_grad_(True) for t in (weight, bias) if t is not None]
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator).to(x.device)
        for start in range(0, len(x), batch):
            rows = order[start : start + batch]
            loss = F.cross_entropy(F.linear(x[rows], *trained), y[rows])
            grads = torch.autograd.grad(loss, trained)
            with torch.no_grad():
                for t, g in zip(trained, grads):
                    t -= lr * g
    return trained[0].detach(), (trained[1].detach() if bias is not None else None)


@register
class CReFF(Algorithm):
    name = "creff"
    settings_class = CReFFSettings
    settings: CReFFSettings

    def __init__(self, settings: Any, train: Any, units: Any) -> None:
        super().__init__(settings, train, units)
        head = head_names(units)
        self.weight = head[0]
        self.bias: str | None = head[1] if len(head) > 1 else None  # FedNH's Conv2Cifar has none
        self.body = len(units) - 1

    def _head(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Params:
        return {self.weight: weight, **({self.bias: bias} if self.bias is not None and bias is not None else {})}

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        weight = server["global"][self.weight]
        C, d = weight.shape
        g = torch_generator(seed, "server", 0, "creff")
        features = torch.randn(C, self.settings.features, d, generator=g)
        w, b = fresh_linear(d, C, g)
        return {**server, "seed": seed, "features": features.to(weight), "head": self._head(w.to(weight), b.to(weight))}

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        payload = super().downlink(server, client_id, round)
        if self.settings.send_retrained:
            payload = {"global": {**payload["global"], **server["head"]}}
        return {**payload, MATCHING_HEAD: server["head"]}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        received = state["model"]
        # real gradients first, at the received body with last round's re-trained classifier
        sums = ctx.class_sums({**received, **payload[MATCHING_HEAD]}, head_gradients(self.weight, self.bias, self.body))
        counts = ctx.label_counts
        fit = self.train_model(received, ctx, self.loss())
        means = sums / counts.clamp(min=1).to(sums.dtype)[..., None]
        upload = self.upload(fit.params, ctx, class_grads=means, class_counts=counts.to(sums.dtype))
        return {**state, "model": fit.params}, upload, {"train_loss": fit.loss}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        cfg = self.settings
        merged = weighted_average([u["params"] for u in uploads], [u["num_samples"] for u in uploads])
        # the ignores: uploads are SentUpload to mypy, class_counts/class_grads are CReFF's own keys
        counts = torch.stack([u["class_counts"] for u in uploads])  # type: ignore[typeddict-item]
        grads = torch.stack([u["class_grads"] for u in uploads])  # type: ignore[typeddict-item]
        holders = (counts > 0).to(grads.dtype)  # [M, C]: which clients hold each class
        target = (holders[..., None] * grads).sum(0) / holders.sum(0).clamp(min=1)[:, None]
        classes = torch.nonzero(holders.sum(0) > 0).flatten().tolist()
        head = server["head"]
        weight = head[self.weight].detach()
        bias = head[self.bias].detach() if self.bias is not None else None
        features = self.match(server["features"], target, classes, weight, bias)
        C, _, d = features.shape
        g = torch_generator(int(server["seed"]), "server", round, "creff")
        fresh_w, fresh_b = fresh_linear(d, C, g)
        start_b = fresh_b.to(weight) if bias is not None else None
        new_w, new_b = retrain_classifier(
            features,
            fresh_w.to(weight),
            start_b,
            cfg.retrain_epochs,
            cfg.retrain_batch or self.train.batch_size,
            cfg.retrain_lr,
            g,
        )
        return {
            **server,
            "global": {**server["global"], **merged},
            "features": features,
            "head": self._head(new_w, new_b),
        }

    def match(
        self,
        features: torch.Tensor,
        target: torch.Tensor,
        classes: list[int],
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``match_steps`` SGD steps on the features, the sum over ``classes`` of the matching distance."""
        features = features.clone().requires_grad_(True)
        C = weight.shape[0]
        for _ in range(self.settings.match_steps if classes else 0):
            distances = (
                matching_distance(
                    classifier_gradient(features[c], c, weight, bias), target[c], C, bias=bias is not None
                )
                for c in classes
            )
            loss = cast(torch.Tensor, sum(distances))  # (classes: not empty in this loop)
            (grad,) = torch.autograd.grad(loss, [features])
            with torch.no_grad():
                features -= self.settings.feature_lr * grad
        return features.detach()

    def global_params(self, server: State) -> Params:
        """The averaged body with the re-trained classifier (the global model CReFF evaluates)."""
        return {**server["global"], **server["head"]}


CReFF.card = MethodCard(
    full_name="CReFF",
    paper=Paper(
        "Federated Learning on Heterogeneous and Long-Tailed Data via Classifier Re-Training with Federated Features",
        "Shang et al.",
        2022,
        "IJCAI",
        "https://arxiv.org/abs/2204.13399",
    ),
    personalised=False,
    shares="Its model, and per class it holds the gradient of last round's re-trained classifier on its real features.",
    keeps="Nothing between rounds.",
    scored="the received global",
    scored_detail="Global accuracy scores the averaged body with the re-trained classifier.",
    client_round="First compute the per-class gradients of last round's re-trained classifier on the real "
    "features (under the received body). Then train as FedAvg. The server averages the models, takes a "
    "plain mean of each class's gradient over the clients holding it, and moves 100 federated features "
    "per class by gradient matching at that same classifier (row-wise cosine distance). It then trains a "
    "fresh linear classifier on them for 300 epochs in mini-batches.",
    references=(
        Reference(
            "shangxinyi/CReFF-FL",
            "fbec98f",
            ("main.py (Global, Local.compute_gradient)", "Dataset/Gradient_matching_loss.py"),
        ),
        Reference("Yutong-Dai/FedNH", "60c3161", ("src/flbase/strategies/CReFF.py",)),
    ),
    tests=(
        "tests/methods/test_creff.py::test_creff_matches_features_with_the_authors_row_wise_distance_at_last_rounds_classifier",
        "tests/methods/test_creff.py::test_creff_round_gradients_at_the_retrained_head_plain_mean_and_a_fresh_retrained_classifier",
        "tests/methods/test_creff.py::test_creff_retraining_is_minibatch_sgd_from_the_given_start",
        "tests/methods/test_creff.py",
    ),
    differences=(
        "The client gradient is the exact class mean. Theirs is the mean of 10 random sub-batches of 32 "
        "with augmentation (the same expectation).",
        "On a head without bias (`conv2cifar`, FedACD's configs) the gradients and the distance have no "
        "bias part, as in FedNH's port. FedNH's port re-trains a head with a bias and keeps its weight; "
        "pflkit re-trains it without (0.6% apart in a toy run, the same predictions).",
        "FedNH's port averages the models uniformly and matches gradients of 64 real samples without augmentation.",
    ),
    choices=(
        Choice(
            "matching steps and rate, re-training epochs, batch and rate",
            "100 / 0.1, 300 epochs of the run's batch size / 0.01 (the authors' code; FedNH's scripts use "
            "feature lr 0.01)",
            "`creff.match_steps`, `creff.feature_lr`, `creff.retrain_epochs`, `creff.retrain_batch`, "
            "`creff.retrain_lr`, `creff.send_retrained`",
        ),
    ),
)

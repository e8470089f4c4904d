"""FedGH (Yi et al., ACM MM 2023): a global head trained on the server from class prototypes.

Each client keeps its body; the head (the model's last unit) is global. A round: take the received
head; train body and head together for E epochs of cross-entropy; upload, per class it holds, the
mean of its body's features over its training samples (evaluation mode, after training). The
server trains its head on the uploaded (prototype, class) pairs with cross-entropy: ``epochs``
epochs of shuffled mini-batches of the run's batch size, plain SGD at ``lr``, from last round's
head. Scored: the client's body with the received global head.

As PFLlib's port (TsingZ0/PFLlib, commit d832e76, ``clientgh.py``, ``servergh.py``). The authors'
code (LipingYi/FedGH, commit ff50ac0, ``FLHetero/FedGH.py``) has the same client round, and a
server loop of one cross-entropy step per prototype that steps the clients' optimiser, not the
head's (its global head never changes): pflkit follows PFLlib's working server; ``batch = 1``
gives the authors' one step per prototype.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, clone, torch_generator
from ..models import head_names
from .base import Algorithm, ClientContext, ClientSummary, Payload, SentUpload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .fedproto import body_features, class_means
from .registry import register


class FedGHSettings(Settings):
    lr: float = Field(1.0, gt=0, description="the server's SGD rate for the global head (PFLlib's -slr: 1.0)")
    epochs: int = Field(1, ge=1, description="the server's epochs over the round's prototypes (PFLlib: 1)")
    batch: int = Field(
        0,
        ge=0,
        description="prototypes per server step (0: the run's batch size, PFLlib's; 1: one step per "
        "prototype, the authors' loop)",
    )


def train_head(
    head: Params,
    weight: str,
    bias: str | None,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    batch: int,
    lr: float,
    generator: torch.Generator,
) -> Params:
    """``epochs`` epochs of plain SGD on CE(linear(x), y) over shuffled mini-batches of ``batch``
    (the last one smaller): a server-side loop on in-memory prototypes, not a client ``ctx.fit``."""
    names = [weight] + ([bias] if bias is not None else [])
    trained = [head[n].detach().clone().requires_grad_(True) for n in names]
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator).to(x.device)
        for start in range(0, len(x), batch):
            rows = order[start : start + batch]
            loss = F.cross_entropy(F.linear(x[rows], *trained), y[rows])
            grads = torch.autograd.grad(loss, trained)
            with torch.no_grad():
                for t, g in zip(trained, grads):
                    t -= lr * g
    return {n: t.detach() for n, t in zip(names, trained)}


def prototype_pairs(uploads: list[SentUpload]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every uploaded (prototype, class) pair of a class its client holds, by client id then class."""
    xs, ys = [], []
    for u in sorted(uploads, key=lambda u: u["client_id"]):
        # the ignores: uploads are SentUpload to mypy, class_means/class_counts are FedGH's own keys
        held = torch.nonzero(u["class_counts"] > 0).flatten()  # type: ignore[typeddict-item]
        xs.append(u["class_means"][held])  # type: ignore[typeddict-item]
        ys.append(held)
    return torch.cat(xs), torch.cat(ys)


@register
class FedGH(Algorithm):
    name = "fedgh"
    settings_class = FedGHSettings
    settings: FedGHSettings
    personal_part = "body"  # the body stays on the clients; the server's head is downloaded
    has_global_model = False  # the server trains a head, never a body

    def __init__(self, settings: Any, train: Any, units: Any) -> None:
        super().__init__(settings, train, units)
        head = head_names(units)
        if len(head) > 2:
            raise ValueError(f"fedgh trains a linear head (a weight and a bias); the model's last unit has {head}")
        self.weight, self.bias = head[0], head[1] if len(head) > 1 else None
        self.body = len(units) - 1

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        return {**server, "seed": seed}

    def init_server(self, init_params: Params) -> State:
        weight = init_params[self.weight]
        if weight.dim() != 2:
            raise ValueError(f"fedgh needs a linear head: {self.weight!r} has shape {tuple(weight.shape)}")
        return {"global": clone(init_params), "seed": 0}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        fit = self.train_model(state["model"], ctx, self.loss())
        sums = ctx.class_sums(fit.params, lambda net, p, x, y: body_features(net, p, x, self.body, train=False))
        counts = ctx.label_counts.to(sums.dtype)
        upload = self.upload({}, ctx, class_means=class_means(sums, counts), class_counts=counts)
        return {**state, "model": fit.params}, upload, {"train_loss": fit.loss}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        if not uploads:
            return server
        cfg = self.settings
        x, y = prototype_pairs(uploads)
        old = server["global"]
        g = torch_generator(int(server["seed"]), "server", round, "fedgh")
        head = train_head(
            old,
            self.weight,
            self.bias,
            x.to(old[self.weight]),
            y.to(old[self.weight].device),
            cfg.epochs,
            cfg.batch or self.train.batch_size,
            cfg.lr,
            g,
        )
        return {**server, "global": {**old, **head}}


FedGH.card = MethodCard(
    full_name="FedGH",
    paper=Paper(
        "FedGH: Heterogeneous Federated Learning with Generalized Global Header",
        "Yi et al.",
        2023,
        "ACM MM",
        "https://arxiv.org/abs/2303.13137",
    ),
    personalised=True,
    shares="Per class it holds, the mean of its body's features (its prototype), with its class counts.",
    keeps="Its body, which is never sent.",
    scored="the local body with the global head",
    client_round="Take the received global head. Train body and head together for E epochs of SGD on "
    "cross-entropy. Upload, per class it holds, the mean of the body's features over its training samples "
    "(evaluation mode). The server trains its head on the round's (prototype, class) pairs: one epoch of "
    "shuffled mini-batches of the run's batch size, plain SGD at lr 1.0.",
    references=(
        Reference(
            "TsingZ0/PFLlib",
            "d832e76",
            ("system/flcore/clients/clientgh.py", "system/flcore/servers/servergh.py"),
        ),
        Reference("LipingYi/FedGH", "ff50ac0", ("FedGH_Codes/experiments/FLHetero/FedGH.py",)),
    ),
    tests=(
        "tests/methods/test_fedgh.py::test_fedgh_client_round_is_pfllibs_clientgh_train_and_collect_protos",
        "tests/methods/test_fedgh.py::test_fedgh_server_is_pfllibs_train_head_over_the_rounds_prototypes",
        "tests/methods/test_fedgh.py::test_fedgh_per_prototype_steps_are_the_authors_server_loop",
    ),
    differences=(
        "The authors' server loop steps the clients' optimiser instead of the head's, so their global head "
        "never leaves its initialisation; pflkit trains it, as PFLlib does.",
        "The authors' client prototype is the mean of per-batch class means over a pass of their shuffled "
        "training loader (evaluation mode, the last batch smaller): the class mean only when every batch holds "
        "as many samples of the class. PFLlib's is the class mean over a pass of its `drop_last` training "
        "loader, which leaves out the n mod B samples of the last partial batch (a class among them alone "
        "sends no prototype that round). pflkit's is the class mean over every training sample, in evaluation "
        "mode; the test compares it with PFLlib's on a client of whole batches.",
        "PFLlib's server head is client 0's head module itself, so client 0's local training also moves it; "
        "pflkit's server head changes only by the server's training.",
        "The authors clip gradients at norm 50 and train with momentum 0.9 and weight decay 1e-3; pflkit uses "
        "the run's optimiser settings.",
        "The authors' server loop (`fedgh.batch = 1`) visits the prototypes in a fixed order (clients, then "
        "their classes) with one optimiser for every round, whose gradients are never zeroed; pflkit's "
        "shuffles them and starts each step from a zero gradient (moot for the authors' numbers, whose step "
        "never moves the head).",
    ),
    choices=(
        Choice(
            "the server's head training",
            "one epoch of mini-batches of the run's batch size, plain SGD at lr 1.0 (PFLlib)",
            "`fedgh.lr`, `fedgh.epochs`, `fedgh.batch` (1: one step per prototype, the authors' loop)",
        ),
    ),
    ala_initialises="the head (only the head is downloaded)",
)

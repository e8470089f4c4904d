"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1 with option II): control variates against
client drift.

The server keeps the global model x and the server control variate c; every client keeps its own
control variate c_i (client state, zero before its first round). A sampled client starts from x,
takes its K local steps y ← y − η_l (g(y) − c_i + c) (K: the client's own number of steps, so
clients of unequal size take unequal K), then sets c_i⁺ = c_i − c + (x − y) / (K η_l) and uploads
y and Δc = c_i⁺ − c_i. The server steps x ← x + η_g · mean(y − x) and c ← c + (1/N) · Σ Δc over the
round's clients (N: all clients), i.e. c ← c + |S|/N · mean Δc.

The correction c − c_i is added to the loss's gradient (``corrected_loss``), before the run's
optimiser: weight decay is added to the corrected gradient and momentum accumulates it. Only the
model's parameters carry control variates; batch-norm statistics take the average, as in FedAvg.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from ..functional import Params, WeightedSum, scale
from ..functional.training import Batch, LossFn, Net
from .base import Algorithm, ClientContext, ClientSummary, Payload, SentUpload, Settings, State, Trained, upload_order
from .card import Choice, MethodCard, Paper, Reference
from .registry import register

#: the server control variate c (server state and payload) and a client's c_i (client state)
CONTROL = "control"
#: the upload's Δc = c_i⁺ − c_i
CONTROL_DELTA = "control_delta"
#: the server state's N, the number of clients (from ``prepare``)
NUM_CLIENTS = "num_clients"


class ScaffoldSettings(Settings):
    server_lr: float = Field(1.0, gt=0, description="server learning rate η_g (Algorithm 1's experiments: 1)")
    model_weights: Literal["uniform", "samples"] = Field(
        "uniform",
        description="how the server averages y − x: uniform over the round's clients (Algorithm 1) "
        "or by training-set size (PFLlib's first SCAFFOLD)",
    )


def corrected_loss(loss: LossFn) -> LossFn:
    """``loss`` whose gradient gains ``aux["correction"]`` (c − c_i) on the parameters it names; the
    added term is 0 in value, so the reported loss stays ``loss``."""

    def with_correction(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        value = loss(net, params, batch, aux)
        for k, v in aux["correction"].items():
            value = value + ((params[k] - params[k].detach()) * v).sum()
        return value

    return with_correction


class ScaffoldStep:
    """SCAFFOLD's server rule as an ``Aggregator``: the uploads folded in ``upload_order`` (the
    models' sum, uniform or by ``total`` samples, and Σ Δc / N), then the step of x and c."""

    def __init__(self, method: Scaffold, server: State, total: float) -> None:
        self.method, self.server = method, server
        self.uniform = method.settings.model_weights == "uniform"
        self.models = WeightedSum(total)
        self.sum: Params | None = None
        self.count = 0
        self.control: Params | None = None

    def add(self, upload: SentUpload) -> None:
        if self.control is None:
            self.control = {k: v.clone() for k, v in self._require(CONTROL).items()}
        params = upload["params"]
        if self.uniform:
            if self.sum is None:
                self.sum = {k: torch.zeros_like(v) for k, v in params.items()}
            for k, acc in self.sum.items():
                acc.add_(params[k])
        else:
            self.models.add(params, upload["num_samples"])
        self.count += 1
        n = self._require(NUM_CLIENTS)
        # the ignore: uploads are SentUpload to mypy, control_delta is SCAFFOLD's own key
        for k, acc in self.control.items():
            acc.add_(upload[CONTROL_DELTA][k], alpha=1.0 / n)  # type: ignore[literal-required]

    def _require(self, key: str) -> Any:
        if key not in self.server:
            raise ValueError(
                f"scaffold: the server state has no {key!r}; start it with init_server and prepare "
                "(a checkpoint written by another method cannot continue this one)"
            )
        return self.server[key]

    def result(self) -> State:
        if self.control is None:
            raise ValueError("cannot aggregate an empty list of uploads")
        if self.uniform:
            assert self.sum is not None
            average = {k: v / self.count for k, v in self.sum.items()}
        else:
            average = self.models.result()
        old, eta = self.server["global"], self.method.settings.server_lr
        names = set(self.method.parameter_names)
        new = {k: (old[k] + eta * (v - old[k]) if k in names else v) for k, v in average.items()}
        return {**self.server, "global": {**old, **new}, CONTROL: self.control}


@register
class Scaffold(Algorithm):
    name = "scaffold"
    settings_class = ScaffoldSettings
    settings: ScaffoldSettings

    # ---- server
    def init_server(self, init_params: Params) -> State:
        server = super().init_server(init_params)
        return {**server, CONTROL: self._zeros(server["global"])}

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        """N, the number of clients, for the update of c."""
        if not clients:
            raise ValueError("scaffold needs at least one client")
        return {**server, NUM_CLIENTS: len(clients)}

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        return {**super().downlink(server, client_id, round), CONTROL: server[CONTROL]}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        step = self.aggregator(server, round, sum(u["num_samples"] for u in uploads))
        for upload in sorted(uploads, key=upload_order):
            step.add(upload)
        return step.result()

    def aggregator(self, server: State, round: int, total: float) -> ScaffoldStep:
        return ScaffoldStep(self, server, total)

    # ---- client
    def init_client(self, init_params: Params, client_id: int) -> State:
        return {**super().init_client(init_params, client_id), CONTROL: self._zeros(init_params)}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        """K corrected SGD steps from the local model (the received x, or ALA's start), then option II."""
        c, c_i = payload[CONTROL], state[CONTROL]
        start = state["model"]
        correction = {k: c[k] - c_i[k] for k in c_i}
        fit = self.train_model(start, ctx, corrected_loss(self.loss()), aux={"correction": correction})
        # a client always steps at least once (one batch of all its samples when it has fewer than a batch)
        inverse = 1.0 / (fit.steps.to(torch.float64).clamp(min=1.0) * ctx.train.lr)
        new = {k: c_i[k] - c[k] + scale(inverse, start[k] - fit.params[k]) for k in c_i}
        delta = {k: new[k] - c_i[k] for k in c_i}
        upload = self.upload(fit.params, ctx, **{CONTROL_DELTA: delta})
        metrics = {"train_loss": fit.loss, "local_steps": fit.steps}
        return {**state, "model": fit.params, CONTROL: new}, upload, metrics

    def _zeros(self, params: Params) -> Params:
        """A zero control variate: one tensor per model parameter."""
        return {k: torch.zeros_like(v) for k, v in self.parameters_of(params).items()}


Scaffold.card = MethodCard(
    full_name="SCAFFOLD",
    paper=Paper(
        "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
        "Karimireddy et al.",
        2020,
        "ICML",
        "https://arxiv.org/abs/1910.06378",
    ),
    personalised=False,
    shares="Its trained model y, its training-set size and Δc = c_i⁺ − c_i; it receives x and c.",
    keeps="Its control variate c_i (zero before its first round). The server keeps c.",
    scored="the received global",
    client_round="Overwrite the local model with the received global x. Take the client's K steps of "
    "y ← y − η_l (g(y) − c_i + c) over E epochs. Set c_i⁺ = c_i − c + (x − y)/(K η_l) (option II). Upload y "
    "and Δc. The server steps x ← x + η_g · mean(y − x) and c ← c + (|S|/N) · mean Δc.",
    references=(
        Reference(
            "TsingZ0/PFLlib",
            "495f8b4",
            (
                "system/flcore/clients/clientscaffold.py",
                "system/flcore/servers/serverscaffold.py",
                "system/flcore/optimizers/fedoptimizer.py (SCAFFOLDOptimizer)",
            ),
        ),
        Reference(
            "TsingZ0/PFLlib",
            "d832e76",
            ("system/flcore/clients/clientscaffold.py", "system/flcore/servers/serverscaffold.py"),
        ),
    ),
    tests=(
        "tests/methods/test_scaffold.py::test_scaffold_matches_pfllib_over_rounds_of_unequal_clients_and_partial_participation",
        "tests/methods/test_scaffold.py::test_scaffold_with_sample_weights_is_pfllib_495f8b4_for_one_epoch",
        "tests/methods/test_scaffold.py::test_momentum_and_weight_decay_apply_to_the_corrected_gradient",
    ),
    pinned=("tests/methods/test_scaffold.py::test_pfllib_495f8b4_updates_c_by_the_sum_not_the_mean",),
    differences=(
        "The authors published no code; PFLlib is the reference. FedALA's commit f1e313a predates PFLlib's "
        "SCAFFOLD: 495f8b4 is its first, d832e76 its latest.",
        "PFLlib 495f8b4 takes K = the number of batches of one epoch, whatever E, so with E > 1 its c_i is "
        "E times the clients' mean gradient (its users reported losses turning NaN after a few rounds). Later "
        "commits and pflkit take the client's own steps over all E epochs: clients of unequal size take "
        "unequal K.",
        "PFLlib 495f8b4 averages y − x by training-set size; Algorithm 1, later PFLlib and pflkit average "
        'uniformly over the round\'s clients. `scaffold.model_weights = "samples"` is the first form.',
        "PFLlib 495f8b4 adds (|S|/N) · Σ Δc to c, |S| times Algorithm 1's (|S|/N) · mean Δc. Later "
        "PFLlib and pflkit follow Algorithm 1.",
        "PFLlib's loader drops incomplete batches, so a client with fewer samples than one batch has no "
        "batch and 1/(K η_l) divides by zero. In pflkit such a client trains on one batch of all its samples "
        "(K = 1 per epoch).",
        "PFLlib's optimiser is plain SGD. pflkit adds c − c_i to the gradient before the run's optimiser: "
        "weight decay is added to the corrected gradient and momentum accumulates it.",
        "Only option II is implemented (option I would take a gradient pass over the client's data at x).",
        "Batch-norm statistics carry no control variate and take the average, as in FedAvg.",
    ),
    choices=(
        Choice("server learning rate η_g", "1", "scaffold.server_lr"),
        Choice("average of y − x", "uniform over the round's clients", "scaffold.model_weights"),
    ),
    notes=(
        "c is server state and each c_i client state: checkpoints carry them and a resumed run continues them.",
        "`local_steps` reports each client's K.",
        "In the digits demo's setting (lr 0.1, Dir(0.1), 20 clients of 37-200 samples) the loss becomes NaN by "
        "round 21 at every seed (at lr 0.03 it ran 25 rounds without one); try a lower lr.",
    ),
    ala_initialises="the local model; c_i⁺ then uses the client's own start in place of x (x itself without ALA)",
)

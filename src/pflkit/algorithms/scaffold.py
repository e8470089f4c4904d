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

Where a client's local training diverges (at a learning rate too high for the corrected steps), its
c_i grows round after round and, through c, every client's correction with it: each round reports
``control_norm``, the largest ‖c_i⁺‖, and a non-finite loss or control variate stops the run with
an error naming the client, the round and the control variates' size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch
from pydantic import Field

from ..functional import Params, WeightedSum, scale
from ..functional.training import ClosedFormTerm, LossFn, NonFiniteLossError, WithTerms
from .base import NUM_CLIENTS as NUM_CLIENTS
from .base import (
    ClientContext,
    CountsClients,
    Payload,
    SentUpload,
    Settings,
    State,
    Trained,
    require_entry,
)
from .card import Choice, MethodCard, Paper, Reference
from .registry import register

#: the server control variate c (server state and payload) and a client's c_i (client state)
CONTROL = "control"
#: the upload's Δc = c_i⁺ − c_i
CONTROL_DELTA = "control_delta"
#: the client metric ‖c_i⁺‖ (a round reports its largest)
CONTROL_NORM = "control_norm"
#: what a non-finite SCAFFOLD run is told to try
LOWER_LR = "SCAFFOLD's corrected local steps need a lower learning rate (lr) than FedAvg's"


class ScaffoldSettings(Settings):
    server_lr: float = Field(1.0, gt=0, description="server learning rate η_g (Algorithm 1's experiments: 1)")
    model_weights: Literal["uniform", "samples"] = Field(
        "uniform",
        description="how the server averages y − x: uniform over the round's clients (Algorithm 1) "
        "or by training-set size (PFLlib's first SCAFFOLD)",
    )


@dataclass(frozen=True)
class Correction(ClosedFormTerm):
    """SCAFFOLD's correction as a loss term: ⟨w − sg(w), c − c_i⟩ (``aux["correction"]``), 0 in value,
    whose gradient c − c_i is added to the loss's."""

    def add_value(self, value: torch.Tensor, params: Params, aux: Any) -> torch.Tensor:
        for k, v in aux["correction"].items():
            value = value + ((params[k] - params[k].detach()) * v).sum()
        return value

    def gradient(self, params: Params, aux: Any) -> dict[str, torch.Tensor]:
        return dict(aux["correction"])

    def add_value_only(self, value: torch.Tensor, params: Params, aux: Any) -> torch.Tensor:
        return value  # each added term is 0


def corrected_loss(loss: LossFn) -> LossFn:
    """``loss`` whose gradient gains ``aux["correction"]`` (c − c_i) on the parameters it names; the
    added term is 0 in value, so the reported loss stays ``loss``."""
    return WithTerms(loss, (Correction(),))


def norms(params: Params, ctx: ClientContext) -> torch.Tensor:
    """‖params‖ over all its tensors, per client (float64; a [K] tensor in a batched context)."""
    dims = len(ctx.client_shape)
    return cast(torch.Tensor, sum(v.double().pow(2).flatten(dims).sum(-1) for v in params.values())).sqrt()


def check_control(control: torch.Tensor, ctx: ClientContext) -> None:
    """NonFiniteLossError naming the first client whose ‖c_i⁺‖ (``control``) is NaN or infinite."""
    bad = (~torch.isfinite(control)).reshape(-1).nonzero().flatten().tolist()
    if bad:
        raise NonFiniteLossError(
            f"scaffold: the control variate c_i of client {ctx.client_ids[bad[0]]} became non-finite in round "
            f"{ctx.round}: its local training diverged. {LOWER_LR}"
        )


class ScaffoldStep:
    """SCAFFOLD's server rule as an ``Aggregator``: the uploads folded in ``upload_order`` (the
    models' sum, uniform or by ``total`` samples, and Σ Δc / N), then the step of x and c."""

    def __init__(self, method: Scaffold, server: State, round: int, total: float) -> None:
        self.method, self.server, self.round = method, server, round
        self.models = WeightedSum() if method.settings.model_weights == "uniform" else WeightedSum(total)
        self.control: Params | None = None

    def add(self, upload: SentUpload) -> None:
        if self.control is None:
            self.control = {k: v.clone() for k, v in require_entry("scaffold", self.server, CONTROL).items()}
        self.models.add(upload["params"], 1.0 if self.models.total is None else upload["num_samples"])
        n = self.method.num_clients(self.server)
        # the ignore: uploads are SentUpload to mypy, control_delta is SCAFFOLD's own key
        delta: Params = upload[CONTROL_DELTA]  # type: ignore[literal-required]
        if not torch.stack([torch.isfinite(v).all() for v in delta.values()]).all():
            raise ValueError(
                f"scaffold: client {upload['client_id']} uploaded a non-finite Δc in round {self.round}: "
                f"its local training diverged. {LOWER_LR}"
            )
        for k, acc in self.control.items():
            acc.add_(delta[k], alpha=1.0 / n)

    def result(self) -> State:
        if self.control is None:
            raise ValueError("cannot aggregate an empty list of uploads")
        average = self.models.result()
        old, eta = self.server["global"], self.method.settings.server_lr
        names = set(self.method.parameter_names)
        new = {k: (old[k] + eta * (v - old[k]) if k in names else v) for k, v in average.items()}
        return {**self.server, "global": {**old, **new}, CONTROL: self.control}


@register
class Scaffold(CountsClients):
    name = "scaffold"
    settings_class = ScaffoldSettings
    settings: ScaffoldSettings
    metric_reductions: ClassVar[dict[str, Literal["mean", "sum", "max", "min"]]] = {CONTROL_NORM: "max"}

    # ---- server
    def init_server(self, init_params: Params) -> State:
        server = super().init_server(init_params)
        return {**server, CONTROL: self._zeros(server["global"])}

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        return {**super().downlink(server, client_id, round), CONTROL: server[CONTROL]}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        return self.fold(server, uploads, round)

    def aggregator(self, server: State, round: int, total: float) -> ScaffoldStep:
        return ScaffoldStep(self, server, round, total)

    # ---- client
    def init_client(self, init_params: Params, client_id: int) -> State:
        return {**super().init_client(init_params, client_id), CONTROL: self._zeros(init_params)}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        """K corrected SGD steps from the local model (the received x, or ALA's start), then option II."""
        c, c_i = payload[CONTROL], state[CONTROL]
        start = state["model"]
        correction = {k: c[k] - c_i[k] for k in c_i}
        try:
            fit = self.train_model(start, ctx, corrected_loss(self.loss()), aux={"correction": correction})
        except NonFiniteLossError as error:
            raise NonFiniteLossError(f"{error}. {self._sizes(c, c_i, ctx)}") from error
        # a client always steps at least once (one batch of all its samples when it has fewer than a batch)
        inverse = 1.0 / (fit.steps.to(torch.float64).clamp(min=1.0) * ctx.train.lr)
        new = {k: c_i[k] - c[k] + scale(inverse, start[k] - fit.params[k]) for k in c_i}
        control = norms(new, ctx)
        check_control(control, ctx)
        delta = {k: new[k] - c_i[k] for k in c_i}
        upload = self.upload(fit.params, ctx, **{CONTROL_DELTA: delta})
        metrics = {"train_loss": fit.loss, "local_steps": fit.steps, CONTROL_NORM: control}
        return {**state, "model": fit.params, CONTROL: new}, upload, metrics

    def round_metrics(self, client_metrics: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
        """Which client's c_i⁺ is the largest (``control_norm_client``; ``control_norm``: its norm)."""
        sizes = {c: float(m[CONTROL_NORM]) for c, m in client_metrics.items() if CONTROL_NORM in m}
        return {f"{CONTROL_NORM}_client": max(sizes, key=lambda c: sizes[c])} if sizes else {}

    @staticmethod
    def _sizes(c: Params, c_i: Params, ctx: ClientContext) -> str:
        """The control variates' norms, and what large ones mean, for the error of a non-finite loss."""
        return (
            f"SCAFFOLD's server control variate c had norm {float(norms(c, ctx).max()):.3g}, these clients' c_i at "
            f"most {float(norms(c_i, ctx).max()):.3g} (each c_i is the mean gradient along the client's last local "
            f"path and c their mean: a c far above a gradient's size means a client's local training diverged in an "
            f"earlier round; each round's {CONTROL_NORM} is the largest ‖c_i‖, {CONTROL_NORM}_client its client). "
            f"{LOWER_LR}"
        )

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
        "tests/methods/test_scaffold.py::test_clients_of_2_to_80_steps_match_pfllib_round_after_round",
        "tests/methods/test_scaffold.py::test_a_client_whose_training_diverges_stops_the_run_naming_it_where_pfllib_goes_on_with_nan",
        "tests/methods/test_scaffold.py::test_a_non_finite_control_variate_stops_the_client_and_the_server_naming_the_client_and_round",
    ),
    pinned=("tests/methods/test_scaffold.py::test_pfllib_495f8b4_updates_c_by_the_sum_not_the_mean",),
    differences=(
        "The authors published no code; PFLlib is the reference. FedALA's commit f1e313a predates PFLlib's "
        "SCAFFOLD: 495f8b4 is its first, d832e76 its latest.",
        "PFLlib 495f8b4 takes K = the number of batches of one epoch, whatever E, so with E > 1 its c_i is "
        "E times the clients' mean gradient (its users reported losses turning NaN after a few rounds: "
        "https://github.com/TsingZ0/PFLlib/issues/152). Later "
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
        "Batch-norm statistics carry no control variate and take the average, as in FedAvg (PFLlib never "
        "synchronises them).",
        "Option II divides by the round's local lr, decayed with `lr_decay`; PFLlib divides by the initial "
        "lr whatever its scheduler does (the same without decay).",
    ),
    choices=(
        Choice("server learning rate η_g", "1", "scaffold.server_lr"),
        Choice("average of y − x", "uniform over the round's clients", "scaffold.model_weights"),
    ),
    notes=(
        "c is server state and each c_i client state: checkpoints carry them and a resumed run continues them.",
        "`local_steps` reports each client's K; `control_norm` the round's largest ‖c_i⁺‖ and `control_norm_client` "
        "its client. A non-finite loss or control variate stops the run with an error naming the client, the round "
        "and the control variates' norms.",
        "SCAFFOLD's corrected steps need a lower lr than FedAvg's. In the digits demo's setting (lr 0.1, Dir(0.1), "
        "20 clients of 37-200 samples) one client's local training diverges round after round (at seed 0 client 5: "
        "its loss from 1.8 at round 3 to 86 at round 18, its ‖c_i‖ from 2.2 to 61), c follows, and the loss is NaN by "
        "round 21 at every seed. With every client's K capped at 3 (equal K) seeds 0, 2 and 3 still diverge "
        "(rounds 53, 38, 33); at lr 0.05 seeds 0-4 run 60 rounds (best accuracy 88.6-92.4%).",
    ),
    ala_initialises="the local model; c_i⁺ then uses the client's own start in place of x (x itself without ALA)",
)

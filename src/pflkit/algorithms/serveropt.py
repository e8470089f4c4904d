"""Server optimisers (FedAvgM, FedAdagrad, FedAdam, FedYogi): FedAvg's clients, and a server that
steps the global model with an optimiser of its own.

The round's pseudo-gradient is Δ = w_avg − w: the sample-weighted average of the uploads minus the
global model. ``ServerOptimizer.update`` turns Δ into the step added to the global model and
advances the optimiser's state (momentum, second moments), which the server state keeps under
``OPTIMIZER`` (so checkpoints carry it and a resumed run continues it). Only the model's parameters
are stepped; batch-norm statistics take the average, as in FedAvg. The average is folded upload by
upload (``ServerStep``), so the server rule streams like FedAvg's; the step runs once, on the
finished average.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..functional import Params, WeightedSum
from .base import Algorithm, SentUpload, Settings, State, upload_order
from .card import Choice, MethodCard, Paper, Reference

#: key of the server state that holds the server optimiser's tensors (name -> parameter dict)
OPTIMIZER = "server_optimizer"
OptimizerState = dict[str, Params]


class ServerLearningRate(Settings):
    """The settings every server optimiser has."""

    server_lr: float = Field(1.0, gt=0, description="server learning rate η")


class ServerStep:
    """A server optimiser's rule as an ``Aggregator``: the uploads' sample-weighted average, folded
    in ``upload_order``, then one optimiser step from it."""

    def __init__(self, method: ServerOptimizer, server: State, round: int, total: float) -> None:
        self.method, self.server, self.round = method, server, round
        self.sum = WeightedSum(total)

    def add(self, upload: SentUpload) -> None:
        self.sum.add(upload["params"], upload["num_samples"])

    def result(self) -> State:
        return self.method.step(self.server, self.sum.result(), self.round)


class ServerOptimizer(Algorithm):
    """Base of the server-optimiser methods (not registered itself): subclasses say how the
    optimiser starts (``init_optimizer``) and steps (``update``)."""

    def init_optimizer(self, params: Params) -> OptimizerState:
        """The optimiser's state before round 1, for the model's parameters ``params``."""
        raise NotImplementedError

    def update(self, state: OptimizerState, delta: Params, round: int) -> tuple[Params, OptimizerState]:
        """(the step added to each parameter, the new optimiser state) from the pseudo-gradient
        ``delta`` = w_avg − w of round ``round`` (1, 2, ...)."""
        raise NotImplementedError

    def init_server(self, init_params: Params) -> State:
        server = super().init_server(init_params)
        return {**server, OPTIMIZER: self.init_optimizer(self.parameters_of(server["global"]))}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        """The sample-weighted average of the uploads (folded in ``upload_order``), then one step."""
        step = ServerStep(self, server, round, sum(u["num_samples"] for u in uploads))
        for upload in sorted(uploads, key=upload_order):
            step.add(upload)
        return step.result()

    def aggregator(self, server: State, round: int, total: float) -> ServerStep:
        return ServerStep(self, server, round, total)

    def step(self, server: State, average: Params, round: int) -> State:
        """The new server state from the round's average: parameters stepped by the optimiser, the
        other averaged entries (batch-norm statistics) taken as they are."""
        if OPTIMIZER not in server:
            raise ValueError(
                f"{self.name}: the server state has no {OPTIMIZER!r}; start it with init_server (a checkpoint "
                "written by another method cannot continue this one)"
            )
        old = server["global"]
        names = [k for k in self.parameter_names if k in average]
        delta = {k: average[k] - old[k] for k in names}
        steps, state = self.update(server[OPTIMIZER], delta, round)
        new = {**old, **average, **{k: old[k] + steps[k] for k in names}}
        kept = server[OPTIMIZER]
        return {**server, "global": new, OPTIMIZER: {key: {**kept.get(key, {}), **state[key]} for key in state}}


def zeros(params: Params) -> Params:
    return {k: torch.zeros_like(v) for k, v in params.items()}


class AdaptiveSettings(ServerLearningRate):
    """The settings of FedAdagrad, FedAdam and FedYogi (Reddi et al., Algorithm 2)."""

    beta1: float = Field(0.9, ge=0, lt=1, description="decay β1 of the first moment m (0: no momentum)")
    tau: float = Field(1e-3, gt=0, description="adaptivity τ, added to √v")
    initial_v: Literal["tau_squared", "zero"] = Field(
        "tau_squared", description="v before round 1: τ² (Algorithm 2 asks v ≥ τ²), or zero as Flower's strategies"
    )


class DecaySettings(AdaptiveSettings):
    """FedAdam's and FedYogi's settings: the decay β2 of the second moment too."""

    beta2: float = Field(0.99, ge=0, lt=1, description="decay β2 of the second moment v")


class AdaptiveOptimizer(ServerOptimizer):
    """FedAdagrad, FedAdam, FedYogi: m ← β1 m + (1 − β1) Δ, v ← ``second_moment(v, Δ²)``, and the
    step η m / (√v + τ) (Reddi et al., Algorithm 2)."""

    settings: AdaptiveSettings

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        """The new second moment from the old ``v`` and the squared pseudo-gradient."""
        raise NotImplementedError

    def learning_rate(self, round: int) -> float:
        """The server learning rate of round ``round`` (default: η in every round)."""
        return self.settings.server_lr

    def init_optimizer(self, params: Params) -> OptimizerState:
        start = 0.0 if self.settings.initial_v == "zero" else self.settings.tau**2
        return {"m": zeros(params), "v": {k: torch.full_like(p, start) for k, p in params.items()}}

    def update(self, state: OptimizerState, delta: Params, round: int) -> tuple[Params, OptimizerState]:
        beta1, tau, lr = self.settings.beta1, self.settings.tau, self.learning_rate(round)
        m = {k: beta1 * state["m"][k] + (1 - beta1) * d for k, d in delta.items()}
        v = {k: self.second_moment(state["v"][k], d * d) for k, d in delta.items()}
        return {k: lr * m[k] / (v[k].sqrt() + tau) for k in delta}, {"m": m, "v": v}


#: the Flower release whose strategies the server optimisers were checked against
FLOWER_RELEASE = "v1.41.0"


def flower_reference(*strategies: str) -> Reference:
    """The Flower strategy files (new ``serverapp`` and legacy ``server`` forms) of ``strategies``."""
    root = "framework/py/flwr"
    files = [f"{root}/{kind}/strategy/{s}.py" for s in strategies for kind in ("serverapp", "server")]
    return Reference("flwrlabs/flower", FLOWER_RELEASE, tuple(files))


FEDOPT_PAPER = Paper(
    "Adaptive Federated Optimization", "Reddi et al.", 2021, "ICLR", "https://arxiv.org/abs/2003.00295"
)


def adaptive_card(
    full_name: str, cls: type[AdaptiveOptimizer], second_moment: str, differences: tuple[str, ...] = ()
) -> MethodCard:
    """The card of FedAdagrad, FedAdam or FedYogi: what they share, the rule of ``v`` (written out),
    the defaults of the class's settings and the method's own ``differences``."""
    name, fields = cls.name, cls.settings_class.model_fields

    def default(key: str) -> str:
        return f"{fields[key].default:g}"

    decay = (Choice("decay β2 of v", default("beta2"), f"{name}.beta2"),) if "beta2" in fields else ()
    return MethodCard(
        full_name=full_name,
        paper=FEDOPT_PAPER,
        personalised=False,
        shares="The whole model and its training-set size, as FedAvg.",
        keeps="Nothing between rounds on the client. The server keeps the moments m and v.",
        scored="the received global",
        client_round="Overwrite the local model with the received global. Train E epochs of SGD on "
        "cross-entropy. Upload the model. The server averages the uploads by sample count (w_avg), takes "
        f"Δ = w_avg − w and steps m ← β1 m + (1 − β1) Δ, {second_moment}, w ← w + η m / (√v + τ).",
        references=(flower_reference(name, "fedopt"),),
        tests=(
            f"tests/methods/test_{name}.py::test_{name}_matches_a_transcription_of_flowers_{name}_over_rounds",
            f"tests/methods/test_{name}.py::test_{name}_by_default_is_algorithm_2",
            "tests/flower/test_flower_strategies.py::test_server_optimizers_give_the_numbers_of_flowers_own_strategies",
        ),
        differences=(
            *differences,
            "Flower starts v at 0; Algorithm 2 asks v ≥ τ² before round 1, and pflkit starts it at τ². "
            f'`{name}.initial_v = "zero"` is Flower\'s form.',
            "Algorithm 2 averages the client updates with equal weights; Flower and pflkit weight them by "
            "training-set size (the same when every client holds as many samples).",
            "Flower steps every array of the model, batch-norm statistics too; pflkit steps the parameters and "
            "takes the average of the statistics, as FedAvg.",
        ),
        choices=(
            Choice("server learning rate η (the paper tunes it per task)", default("server_lr"), f"{name}.server_lr"),
            Choice("decay β1 of m", default("beta1"), f"{name}.beta1"),
            *decay,
            Choice(
                "adaptivity τ (Flower 1.41: 1e-3; its legacy FedAdam and FedAdagrad: 1e-9)",
                default("tau"),
                f"{name}.tau",
            ),
            Choice("v before round 1", "τ²", f"{name}.initial_v"),
        ),
        notes=("m and v are part of the server state: checkpoints carry them and a resumed run continues them.",),
    )

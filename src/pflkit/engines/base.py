"""What every engine executes: client jobs and their results, and what is fixed for a run's rounds."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..algorithms.base import Algorithm, Payload, State, Upload
from ..algorithms.context import TrainSettings
from ..data.federated import FederatedData
from ..functional import Ensemble, Params
from ..models import UnitModel, Units
from .client import SingleClientContext
from .fitting import JobsAbandoned  # noqa: F401  (part of this module's interface)

#: The wall times every client result carries, which a round's record sums over its clients
#: (every other numeric client metric is averaged unless its method says otherwise).
CLIENT_TIMINGS = {"init_seconds": "sum", "eval_seconds": "sum", "train_seconds": "sum"}


@dataclass
class ClientJob:
    """One client's part of a round: its payload and state (None on Flower's server side, or until
    ``load`` reads it: clients kept on disk are read when their job starts, not when it is planned).
    ``finetune``: a client that never trained (a newcomer), whose scored model is fine-tuned for this
    many epochs before its evaluation (None: a participant); ``finetune_steps``: for this many
    batches instead; ``finetune_lr``: at this learning rate (None: the run's).
    ``work``: the share of its planned local steps the client takes in ``local_train`` (1: all;
    less: a straggler)."""

    client_id: int
    payload: Payload
    state: State | None
    evaluate: bool
    train: bool = True
    load: Callable[[], State] | None = None
    finetune: int | None = None
    finetune_steps: int | None = None
    finetune_lr: float | None = None
    work: float = 1.0

    def loaded(self) -> ClientJob:
        """The job with its state read (itself where nothing is left to read)."""
        return self if self.load is None else replace(self, state=self.load(), load=None)


@dataclass
class ClientResult:
    client_id: int
    state: State | None
    upload: Upload | None
    evaluation: dict[str, float] | None
    metrics: dict[str, Any] = field(default_factory=dict)


#: A metric of every participant's trained local model, computed where the client trains, after
#: training: ``metric(setup, client_id, params) -> {name: JSON value}``, merged into the client's
#: metrics (``pflkit.federation.evaluation.AdaptabilityMetrics`` is one).
LocalModelMetric = Callable[["RoundSetup", int, Params | Ensemble], dict[str, Any]]


@dataclass
class RoundSetup:
    """Everything fixed for a run that client functions need besides state and payload.
    ``local_model_metrics``: computed on each trained local model (``Algorithm.local_model``)."""

    algorithm: Algorithm
    data: FederatedData
    model: UnitModel
    units: Units
    train: TrainSettings
    seed: int
    local_model_metrics: tuple[LocalModelMetric, ...] = ()
    #: set when the jobs in flight are to be abandoned: client training stops at its next step
    cancel: threading.Event | None = None

    def context(self, client_id: int, round: int) -> SingleClientContext:
        return SingleClientContext(
            client_id,
            round,
            self.seed,
            self.data.client(client_id),
            self.model,
            self.units,
            self.train,
            self.algorithm.name,
            cancel=self.cancel,
        )


class Engine(Protocol):
    """Runs the client jobs of one round: ``run`` returns their results in job order; ``stream``
    yields each as it is done, in the order weighted-sum server rules fold uploads in (training-set
    size, largest first, then client id), holding only the clients in flight."""

    def run(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> list[ClientResult]: ...

    def stream(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> Iterator[ClientResult]: ...

    def close(self) -> None: ...

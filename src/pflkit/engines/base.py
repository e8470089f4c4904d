"""What every engine executes: client jobs and their results, and what is fixed for a run's rounds."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn

from ..algorithms.base import Algorithm, Payload, State, Upload
from ..algorithms.context import TrainSettings
from ..data.federated import FederatedData
from ..functional import Params, prediction_logits
from ..functional.training import probability_matrix, probability_sums, template_kl
from ..models import Units
from .client import SingleClientContext


@dataclass
class ClientJob:
    """One client's part of a round: its payload and state (None on Flower's server side, or until
    ``load`` reads it: clients kept on disk are read when their job starts, not when it is planned)."""

    client_id: int
    payload: Payload
    state: State | None
    evaluate: bool
    train: bool = True
    load: Callable[[], State] | None = None

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


@dataclass
class RoundSetup:
    """Everything fixed for a run that client functions need besides state and payload.
    ``adaptability``: the template gamma of the optional adaptability metrics (None: off)."""

    algorithm: Algorithm
    data: FederatedData
    model: nn.Module
    units: Units
    train: TrainSettings
    seed: int
    adaptability: float | None = None

    def context(self, client_id: int, round: int) -> SingleClientContext:
        return SingleClientContext(client_id, round, self.seed, self.data.client(client_id), self.model,  # type: ignore
                                   self.units, self.train, self.algorithm.name)


@torch.no_grad()
def adaptability_metrics(setup: RoundSetup, client_id: int, params: Params) -> dict[str, Any]:
    """A trained local model's per-class correct predictions on the global test set (the driver
    turns them into its risk over the clients' distributions, FedACD Table 3) and KL(P^m || T) of
    its probability matrix over the client's training data (FedACD Table 9, spec §3.9)."""
    test = setup.data.global_test
    if test is None:
        raise ValueError("metrics.adaptability needs the global test set (test_set = \"official\")")
    C, client = setup.data.num_classes, setup.data.client(client_id)
    correct = torch.zeros(C, device=test[1].device)
    for i in range(0, len(test[1]), setup.train.eval_batch_size):
        x, y = test[0][i:i + setup.train.eval_batch_size], test[1][i:i + setup.train.eval_batch_size]
        correct.index_add_(0, y, (prediction_logits(setup.model, params, x).argmax(1) == y).to(correct.dtype))
    sums = probability_sums(setup.model, params, client.train_x, client.train_y, C, setup.train.eval_batch_size)
    counts = torch.bincount(client.train_y, minlength=C)
    kl = template_kl(probability_matrix(sums, counts), counts, setup.adaptability)
    return {"class_correct": correct.tolist(), "local_kl": float(kl)}


class Engine(Protocol):
    """Runs the client jobs of one round: ``run`` returns their results in job order; ``stream``
    yields each as it is done, in the order weighted-sum server rules fold uploads in (training-set
    size, largest first, then client id), holding only the clients in flight."""

    def run(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> list[ClientResult]: ...

    def stream(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> Iterator[ClientResult]: ...

    def close(self) -> None: ...

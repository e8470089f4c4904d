"""The batch schedule both client contexts draw: which samples every step of an epoch uses.

A client's epochs over its training data come from its own (seed, round, client, purpose)
streams: a fresh permutation per epoch cut into full batches (drop_last; fewer samples than a
batch make one batch of all of them), the held-out tail left out, a step budget across epochs,
and with mixup each batch's coefficient and partner order. ``SingleClientContext`` turns an
epoch into batches one by one; ``BatchedClientContext`` turns the epochs of K clients into
[K, S, b] row tables. Both read the same :class:`ClientSchedule`, so they draw the same
numbers in the same order by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..algorithms.context import TrainBatches
from ..functional import numpy_generator, torch_generator


def batch_order(n: int, batch_size: int, generator: torch.Generator) -> list[Tensor]:
    """One epoch of index batches of one client: a fresh permutation, full batches only
    (drop_last), except that fewer than ``batch_size`` samples make one batch of all of them."""
    if n == 0:
        return []
    full = n // batch_size if n >= batch_size else 1
    size = batch_size if n >= batch_size else n
    order = torch.randperm(n, generator=generator)
    return [order[k * size : (k + 1) * size] for k in range(full)]


def split_halves(n: int, batch_size: int) -> int:
    """Size of B in PFLlib's split pairs for a batch of ``n`` samples (B' is the rest)."""
    return min(batch_size, (n + 1) // 2)


def training_part(n: int, holdout: float) -> int:
    """How many leading training samples remain when the last ``holdout`` share is held out
    (at least one held out and one kept; a client with one sample keeps it)."""
    if not holdout or n < 2:
        return n
    return n - min(n - 1, max(1, int(n * holdout)))


def holdout_positions(n: int, holdout: float) -> slice:
    """Positions of the held-out tail (a client with a single training sample validates on it)."""
    kept = training_part(n, holdout)
    return slice(0, n) if kept == n else slice(kept, n)


def sample_positions(n: int, fraction: float, sampling: str, generator: torch.Generator) -> Tensor:
    """Positions (in a client's training data) of a ``fraction`` sample: at least one sample."""
    k = max(1, int(fraction * n))
    if sampling == "random":
        return torch.randperm(n, generator=generator)[:k]
    start = int(torch.randint(0, n - k + 1, (1,), generator=generator))
    return torch.arange(start, start + k)


@dataclass
class Epoch:
    """One epoch of one client: index batches (positions in its training data) and, with mixup,
    each batch's (lambda, partner order)."""

    batches: list[Tensor]
    mixup: list[tuple[float, np.ndarray]] | None = None


class ClientSchedule:
    """The epochs of one ``TrainBatches`` spec for one client, drawn in order from its streams."""

    def __init__(
        self,
        spec: TrainBatches,
        num_train: int,
        batch_size: int,
        seed: int,
        round: int,
        client_id: int,
        mixup: bool,
        mixup_alpha: float,
    ) -> None:
        self.n = training_part(num_train, spec.holdout)
        self.batch_size = spec.batch_size or batch_size
        self.budget = spec.max_steps
        self.generator = torch_generator(seed, "client", round, client_id, spec.purpose)
        mixing = mixup if spec.mixup is None else spec.mixup
        self.mixer = numpy_generator(seed, "client", round, client_id, spec.purpose, "mixup") if mixing else None
        self.alpha = mixup_alpha

    def next_epoch(self) -> Epoch:
        order = batch_order(self.n, self.batch_size, self.generator)
        if self.budget is not None:
            order = order[: self.budget]
            self.budget -= len(order)
        if self.mixer is None:
            return Epoch(order)
        mixer, a = self.mixer, self.alpha
        return Epoch(order, [(float(mixer.beta(a, a)), mixer.permutation(len(idx))) for idx in order])

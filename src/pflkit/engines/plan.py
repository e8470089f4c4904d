"""The one plan of batches that both client contexts follow.

A data specification (``TrainBatches``, ``SplitBatches``, ``PairedBatches``, ``SampleBatches``)
becomes, for each client, a list of steps per epoch; a step is one :class:`Rows` (positions in
the client's source: its training data, their cached features, or a drawn sample) or a tuple of
them (paired streams, split pairs). The draws come from :class:`~.schedule.ClientSchedule`, so
``SingleClientContext``, which turns a client's steps into batches one by one, and
``BatchedClientContext``, which turns the steps of K clients into one [K, S, b] table per epoch
(:class:`EpochTable`), use the same samples in the same order by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..algorithms.context import DataSpec, PairedBatches, SampleBatches, SplitBatches, TrainBatches, TrainSettings
from ..functional.training import Batch, mix
from .schedule import ClientSchedule, Epoch, split_halves


@dataclass(frozen=True)
class Rows:
    """One batch of one client: ``positions`` in its source (a slice for a contiguous run), and
    with mixup the batch's coefficient and partner order."""

    positions: Tensor | slice
    lam: float | None = None
    perm: np.ndarray | None = None

    def size(self) -> int:
        p = self.positions
        return p.stop - p.start if isinstance(p, slice) else len(p)

    def index(self) -> Tensor:
        p = self.positions
        return torch.arange(p.start, p.stop) if isinstance(p, slice) else p

    def batch(self, x: Tensor, y: Tensor) -> Batch:
        """The batch these rows select from one client's ``x`` and ``y``."""
        p = self.positions if isinstance(self.positions, slice) else self.positions.to(x.device)
        if self.lam is None or self.perm is None:
            return Batch(x[p], y[p])
        return mix(x[p], y[p], self.lam, torch.as_tensor(self.perm, device=x.device))


#: One step of one client: a batch, or several taken together.
Step = Rows | tuple[Rows, ...]


class ClientPlan:
    """The steps of a data specification for one client, epoch by epoch (drawn in order).

    ``num_train``: the client's training samples; ``sample_length``: the size of the drawn sample
    (``SampleBatches`` only); ``work``: the share of the planned steps (``epochs`` times
    ``per_epoch``, at most ``max_steps``) the client takes, the first ones (a straggler: rounded
    down, at least one)."""

    def __init__(
        self,
        spec: DataSpec,
        num_train: int,
        train: TrainSettings,
        seed: int,
        round: int,
        client_id: int,
        sample_length: int | None = None,
        work: float = 1.0,
    ) -> None:
        self.spec = spec
        b = train.batch_size
        self.per_epoch: int
        self._next: Callable[[], list[Step]]
        if isinstance(spec, TrainBatches):
            schedule = ClientSchedule(spec, num_train, b, seed, round, client_id, train.mixup, train.mixup_alpha)
            self._next = lambda: [
                Rows(idx, *(mixing or (None, None))) for idx, mixing in zip(*_with_mixup(schedule.next_epoch()))
            ]
            self.epochs = spec.epochs
            self.per_epoch = _batches(schedule.n, schedule.batch_size)
        elif isinstance(spec, SplitBatches):
            if train.mixup:
                raise ValueError(
                    "mixup does not apply to split batch pairs (Per-FedAvg's B and B'): "
                    "set train.mixup = false for this method"
                )
            schedule = ClientSchedule(
                TrainBatches(spec.purpose, spec.epochs, 2 * b),
                num_train,
                b,
                seed,
                round,
                client_id,
                False,
                train.mixup_alpha,
            )
            self._next = lambda: [_split(idx, b) for idx in schedule.next_epoch().batches]
            self.epochs = spec.epochs
            self.per_epoch = _batches(schedule.n, schedule.batch_size)
        elif isinstance(spec, PairedBatches):
            streams = [ClientPlan(s, num_train, train, seed, round, client_id) for s in spec.streams]
            self._next = lambda: list(zip(*(s.next_epoch() for s in streams)))
            self.epochs = min(s.epochs for s in streams)
            self.per_epoch = min(s.per_epoch for s in streams)
        elif isinstance(spec, SampleBatches):
            if sample_length is None:
                raise ValueError("a SampleBatches plan needs the sample's length")
            fixed: list[Step] = [Rows(slice(i, min(i + b, sample_length))) for i in range(0, sample_length, b)]
            self._next = lambda: fixed
            self.epochs = 1
            self.per_epoch = len(fixed)
        else:
            raise TypeError(f"unknown data specification {spec!r}")
        planned = self.epochs * self.per_epoch
        if isinstance(spec, TrainBatches) and spec.max_steps is not None:
            planned = min(planned, spec.max_steps)
        self.budget = step_cap(planned, work)

    def next_epoch(self) -> list[Step]:
        steps = self._next()
        if self.budget is not None:
            steps = steps[: self.budget]
            self.budget -= len(steps)
        return steps


def step_cap(planned: int, work: float) -> int | None:
    """The steps a client completes of ``planned`` at ``work`` (rounded down, at least one);
    None: all of them."""
    if work >= 1:
        return None
    return max(1, int(round(work * planned, 9)))


def _batches(n: int, batch_size: int) -> int:
    """Batches of one epoch over ``n`` samples (``schedule.batch_order``)."""
    return 0 if n == 0 else max(1, n // batch_size)


def _with_mixup(epoch: Epoch) -> tuple[list[Tensor], list[tuple[float, np.ndarray] | None]]:
    mixup: list[tuple[float, np.ndarray] | None] = (
        list(epoch.mixup) if epoch.mixup is not None else [None] * len(epoch.batches)
    )
    return epoch.batches, mixup


def _split(idx: Tensor, batch_size: int) -> tuple[Rows, Rows]:
    """PFLlib's split pair of a batch of up to 2b samples: B = the first min(b, ceil(n/2)), B' the
    rest (a batch of one sample is used for both)."""
    h = split_halves(len(idx), batch_size)
    first = Rows(idx[:h])
    return first, (Rows(idx[h:]) if len(idx) > h else first)


def materialize(step: Step, x: Tensor, y: Tensor) -> Batch | tuple[Batch, ...]:
    """One client's step as batches of its source ``x``, ``y``."""
    if isinstance(step, Rows):
        return step.batch(x, y)
    return tuple(rows.batch(x, y) for rows in step)


# ---- K clients at once ------------------------------------------------------------------------
@dataclass
class Table:
    """One stream of K clients' epoch: rows of the flat source [K, S, b], the mask of real
    samples, and with mixup each batch's lam [K, S] and partner positions [K, S, b]."""

    rows: Tensor
    mask: Tensor
    lam: Tensor | None = None
    perm: Tensor | None = None

    def batch(self, x: Tensor, y: Tensor, step: int | Tensor, clients: Tensor | slice) -> Batch:
        """Step ``step`` of ``clients``; ``step`` may be a 0-dim device tensor (a recorded step's)."""
        rows, mask = _at_step(self.rows, step)[clients], _at_step(self.mask, step)[clients]
        if self.lam is None or self.perm is None:
            return Batch(x[rows], y[rows], mask)
        lam, perm = _at_step(self.lam, step)[clients], _at_step(self.perm, step)[clients]
        return mix(x[rows], y[rows], lam, perm)._replace(mask=mask)


def _at_step(table: Tensor, step: int | Tensor) -> Tensor:
    """Column ``step`` of a [K, S, ...] table. A tensor step is gathered on its device: indexing
    with a 0-dim integer tensor reads it back to the host (``item``), which a CUDA graph cannot record."""
    if isinstance(step, Tensor):
        return table.index_select(1, step.reshape(1)).squeeze(1)
    return table[:, step]


@dataclass
class EpochTable:
    """K clients' steps of one epoch as tables: ``steps`` [K] (CPU), one :class:`Table` per
    stream (one, or one per member of a step's tuple)."""

    steps: Tensor
    tables: list[Table]
    paired: bool

    @classmethod
    def build(
        cls, epochs: list[list[Step]], to_rows: Callable[[int, Tensor], Tensor], device: torch.device
    ) -> EpochTable:
        """The tables of K clients' epochs; ``to_rows(k, positions)`` maps client ``k``'s positions
        to rows of the flat source the batches are gathered from."""
        steps = torch.tensor([len(e) for e in epochs])
        first = next((e[0] for e in epochs if e), None)
        paired = isinstance(first, tuple)
        width = len(first) if isinstance(first, tuple) else 1
        members = [[[s[j] if isinstance(s, tuple) else s for s in e] for e in epochs] for j in range(width)]
        return cls(
            steps, [_table(m, to_rows, max(int(steps.max()), 1) if len(steps) else 1, device) for m in members], paired
        )

    def batch(self, x: Tensor, y: Tensor, step: int | Tensor, clients: Tensor | slice) -> Batch | tuple[Batch, ...]:
        batches = [t.batch(x, y, step, clients) for t in self.tables]
        return tuple(batches) if self.paired else batches[0]


def _table(epochs: list[list[Rows]], to_rows: Callable[[int, Tensor], Tensor], S: int, device: torch.device) -> Table:
    K = len(epochs)
    b = max((r.size() for e in epochs for r in e), default=1)
    rows = torch.zeros(K, S, b, dtype=torch.long)
    mask = torch.zeros(K, S, b)
    mixing = any(r.lam is not None for e in epochs for r in e)
    lam = torch.ones(K, S) if mixing else None
    perm = torch.arange(b).repeat(K, S, 1) if mixing else None
    for k, epoch in enumerate(epochs):
        for s, r in enumerate(epoch):
            n = r.size()
            rows[k, s, :n] = to_rows(k, r.index())
            mask[k, s, :n] = 1.0
            if r.lam is not None and lam is not None and perm is not None:
                lam[k, s] = r.lam
                perm[k, s, :n] = torch.as_tensor(r.perm)
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return Table(rows.to(device), mask.to(device), to(lam), to(perm))

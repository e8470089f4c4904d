"""Unreliable clients: who drops out of a round and who straggles, drawn from the run's seed.

Every decision is a draw of its own (seed, round, client) stream, so a run with dropout or
stragglers is reproducible, the same on every engine and on Flower, and a resumed run takes the
same decisions without saving any random state.

* A dropped client is absent from its round: its job is never run (no training, no upload, no
  evaluation in that round's reply), so its state stays as it was. The round aggregates the
  uploads that arrived; a round whose selected clients all dropped leaves the server state as it
  was. With ``eval_all_clients`` the simulator still scores a dropped client's unchanged state, as
  it scores the clients not selected. On Flower a client whose reply is lost after it trained
  counts as dropped too (``tolerate_failures``; the record's ``lost_replies`` names it), and its
  node sets aside the state it saved after that round when it is next reached, so it goes on as
  the simulator's dropped client does.
* A straggler completes only ``straggler_work`` of the local steps of each fit of its
  ``local_train`` that round (rounded down, at least one): methods see their real step counts
  (``Fit.steps``). Fits of the local initialisation (ALA, FedAS's alignment) are not shortened.
* A round deadline (``round_deadline``) runs on a simulated clock. Each client has a speed, drawn
  once a run from (seed, client): log-normal with median 1 and spread ``client_speed_spread``. A
  client of speed s completes floor(deadline x s) local steps by the deadline. One whose planned
  steps (local epochs x its batches of one epoch) are more returns the share it completed, as a
  straggler does (at least one step), or, with ``deadline_policy = "drop"``, fails to return.
  Wall-clock time plays no part, so a run with a deadline is reproducible and the same on Flower.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..algorithms import TrainSettings
from ..config.errors import ConfigError
from ..config.sections import RunSettings
from ..engines.base import ClientJob
from ..functional import numpy_generator


@dataclass(frozen=True)
class Reliability:
    """How selected clients fail: ``dropout_rate`` (each selected client independently),
    ``dropout_schedule`` (round -> clients that drop then, if selected), ``straggler_rate`` (each
    remaining client independently) completing ``straggler_work`` of its local steps."""

    dropout_rate: float = 0.0
    dropout_schedule: dict[int, frozenset[int]] = field(default_factory=dict)
    straggler_rate: float = 0.0
    straggler_work: float = 1.0
    round_deadline: float | None = None
    speed_spread: float = 0.0
    drop_late: bool = False
    planned_steps: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.dropout_rate < 1:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if not 0 <= self.straggler_rate <= 1:
            raise ValueError(f"straggler_rate must be in [0, 1], got {self.straggler_rate}")
        if not 0 < self.straggler_work <= 1:
            raise ValueError(f"straggler_work must be in (0, 1], got {self.straggler_work}")
        if self.round_deadline is not None and self.round_deadline <= 0:
            raise ValueError(f"round_deadline must be positive, got {self.round_deadline}")

    @classmethod
    def of(
        cls,
        dropout_rate: float = 0.0,
        dropout_schedule: Iterable[Sequence[int]] = (),
        straggler_rate: float = 0.0,
        straggler_work: float = 1.0,
        round_deadline: float | None = None,
        speed_spread: float = 0.0,
        drop_late: bool = False,
        planned_steps: dict[int, int] | None = None,
    ) -> Reliability | None:
        """The rule of these settings, or None where every client is reliable;
        ``dropout_schedule``: ``[round, client]`` pairs; ``planned_steps``: client -> the local
        steps it plans a round (what a deadline is measured against)."""
        schedule: dict[int, set[int]] = {}
        for pair in dropout_schedule:
            round, client = pair
            schedule.setdefault(int(round), set()).add(int(client))
        rule = cls(
            dropout_rate,
            {r: frozenset(c) for r, c in schedule.items()},
            straggler_rate,
            straggler_work,
            round_deadline,
            speed_spread,
            drop_late,
            dict(planned_steps or {}),
        )
        return rule if rule.active else None

    @property
    def active(self) -> bool:
        return bool(
            self.dropout_rate
            or self.dropout_schedule
            or (self.straggler_rate and self.straggler_work < 1)
            or self.round_deadline is not None
        )

    def dropped(self, seed: int, round: int, selected: Sequence[int]) -> list[int]:
        """The clients of ``selected`` that fail to return their upload in ``round`` (with
        ``drop_late``, those the deadline cuts short too)."""
        scheduled = self.dropout_schedule.get(round, frozenset())
        return [
            c
            for c in selected
            if c in scheduled
            or self._draw(seed, "dropout", round, c) < self.dropout_rate
            or (self.drop_late and self.deadline_share(seed, c) < 1)
        ]

    def work(self, seed: int, round: int, client: int) -> float:
        """The share of its local steps ``client`` completes in ``round`` (1: all of them)."""
        share = self.deadline_share(seed, client)
        if self.straggler_work < 1 and self._draw(seed, "straggler", round, client) < self.straggler_rate:
            return min(share, self.straggler_work)
        return share

    def speed(self, seed: int, client: int) -> float:
        """``client``'s speed in run ``seed`` (local steps per unit of the deadline; median 1)."""
        if not self.speed_spread:
            return 1.0
        return float(np.exp(self.speed_spread * numpy_generator(seed, "speed", client).standard_normal()))

    def deadline_share(self, seed: int, client: int) -> float:
        """The share of its planned local steps ``client`` completes by the round deadline (1:
        all, or no deadline); the steps completed are floor(deadline x speed), at least one."""
        planned = self.planned_steps.get(client, 0)
        if self.round_deadline is None or planned == 0:
            return 1.0
        done = max(1, math.floor(round(self.round_deadline * self.speed(seed, client), 9)))
        return min(1.0, done / planned)

    @staticmethod
    def _draw(seed: int, purpose: str, round: int, client: int) -> float:
        return float(numpy_generator(seed, purpose, round, client).random())


def planned_steps(train: TrainSettings, sizes: Mapping[int, int]) -> dict[int, int]:
    """client -> the local steps of its round under ``train`` (local epochs x its full batches,
    at least one batch): what a round deadline is measured against. ``sizes``: client -> its
    training samples."""
    return {c: train.local_epochs * (max(1, n // train.batch_size) if n else 0) for c, n in sizes.items()}


def reliability_of(run: RunSettings, num_clients: int, steps: Mapping[int, int] | None = None) -> Reliability | None:
    """The unreliable clients of a config's ``[run]`` section (None: every client is reliable) in a
    run of ``num_clients`` clients: the count of the data as read, which a PFLlib or LEAF folder
    sets (a schedule naming a client it lacks is refused here). ``steps``: each client's planned
    local steps (``planned_steps``), which a round deadline needs."""
    for round, client in run.dropout_schedule:
        if not 0 <= client < num_clients:
            raise ConfigError(
                f"run.dropout_schedule names client {client} in round {round}, but the data has "
                f"{num_clients} clients (0..{num_clients - 1})"
            )
    if run.round_deadline is not None and steps is None:
        raise ValueError("a round deadline needs the clients' planned steps")
    return Reliability.of(
        run.dropout_rate,
        run.dropout_schedule,
        run.straggler_rate,
        run.straggler_work,
        run.round_deadline,
        run.client_speed_spread,
        run.deadline_policy == "drop",
        dict(steps or {}),
    )


def round_fields(
    dropped: Sequence[int], jobs: Sequence[ClientJob], arrived: int, lost: Sequence[int] = ()
) -> dict[str, Any]:
    """What a training round's record says of its unreliable clients: how many dropped, how many
    straggled, whether no upload arrived (the server state then stayed as it was), and which
    dropped clients' replies were lost on Flower (``lost_replies``: their nodes roll the round back)."""
    out: dict[str, Any] = {
        "dropped_clients": len(dropped),
        "straggler_clients": sum(1 for job in jobs if job.work < 1),
    }
    if lost:
        out["lost_replies"] = sorted(lost)
    if not arrived:
        out["aggregation_skipped"] = True
    return out

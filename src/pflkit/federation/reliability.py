"""Unreliable clients: who drops out of a round and who straggles, drawn from the run's seed.

Every decision is a draw of its own (seed, round, client) stream, so a run with dropout or
stragglers is reproducible, the same on every engine and on Flower, and a resumed run takes the
same decisions without saving any random state.

* A dropped client is absent from its round: its job is never run (no training, no upload, no
  evaluation in that round's reply), so its state stays as it was. The round aggregates the
  uploads that arrived; a round whose selected clients all dropped leaves the server state as it
  was. With ``eval_all_clients`` the simulator still scores a dropped client's unchanged state, as
  it scores the clients not selected. In a deployment a client whose reply is lost after it
  trained keeps its trained state on its node (the server cannot undo it); the simulator models a
  client that fails before its result counts.
* A straggler completes only ``straggler_work`` of the local steps of each fit of its
  ``local_train`` that round (rounded down, at least one): methods see their real step counts
  (``Fit.steps``). Fits of the local initialisation (ALA, FedAS's alignment) are not shortened.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

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

    def __post_init__(self) -> None:
        if not 0 <= self.dropout_rate < 1:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if not 0 <= self.straggler_rate <= 1:
            raise ValueError(f"straggler_rate must be in [0, 1], got {self.straggler_rate}")
        if not 0 < self.straggler_work <= 1:
            raise ValueError(f"straggler_work must be in (0, 1], got {self.straggler_work}")

    @classmethod
    def of(
        cls,
        dropout_rate: float = 0.0,
        dropout_schedule: Iterable[Sequence[int]] = (),
        straggler_rate: float = 0.0,
        straggler_work: float = 1.0,
    ) -> Reliability | None:
        """The rule of these settings, or None where every client is reliable;
        ``dropout_schedule``: ``[round, client]`` pairs."""
        schedule: dict[int, set[int]] = {}
        for pair in dropout_schedule:
            round, client = pair
            schedule.setdefault(int(round), set()).add(int(client))
        rule = cls(dropout_rate, {r: frozenset(c) for r, c in schedule.items()}, straggler_rate, straggler_work)
        return rule if rule.active else None

    @property
    def active(self) -> bool:
        return bool(self.dropout_rate or self.dropout_schedule or (self.straggler_rate and self.straggler_work < 1))

    def dropped(self, seed: int, round: int, selected: Sequence[int]) -> list[int]:
        """The clients of ``selected`` that fail to return their upload in ``round``."""
        scheduled = self.dropout_schedule.get(round, frozenset())
        return [c for c in selected if c in scheduled or self._draw(seed, "dropout", round, c) < self.dropout_rate]

    def work(self, seed: int, round: int, client: int) -> float:
        """The share of its local steps ``client`` completes in ``round`` (1: all of them)."""
        if self.straggler_work < 1 and self._draw(seed, "straggler", round, client) < self.straggler_rate:
            return self.straggler_work
        return 1.0

    @staticmethod
    def _draw(seed: int, purpose: str, round: int, client: int) -> float:
        return float(numpy_generator(seed, purpose, round, client).random())


def reliability_of(run: RunSettings, num_clients: int) -> Reliability | None:
    """The unreliable clients of a config's ``[run]`` section (None: every client is reliable) in a
    run of ``num_clients`` clients: the count of the data as read, which a PFLlib or LEAF folder
    sets (a schedule naming a client it lacks is refused here)."""
    for round, client in run.dropout_schedule:
        if not 0 <= client < num_clients:
            raise ConfigError(
                f"run.dropout_schedule names client {client} in round {round}, but the data has "
                f"{num_clients} clients (0..{num_clients - 1})"
            )
    return Reliability.of(run.dropout_rate, run.dropout_schedule, run.straggler_rate, run.straggler_work)


def round_fields(dropped: Sequence[int], jobs: Sequence[ClientJob], arrived: int) -> dict[str, Any]:
    """What a training round's record says of its unreliable clients: how many dropped, how many
    straggled, and whether no upload arrived (the server state then stayed as it was)."""
    out: dict[str, Any] = {
        "dropped_clients": len(dropped),
        "straggler_clients": sum(1 for job in jobs if job.work < 1),
    }
    if not arrived:
        out["aggregation_skipped"] = True
    return out

"""A run session: one (algorithm, seed) run's rounds, its client store and its outputs.

``RunSession`` holds the run's state (server state, client store, history), its round driver
and the callbacks that watch every record (checkpoints, ``metrics.jsonl``, progress, traces,
trackers). Whoever runs the clients supplies only how a round's jobs execute:

    session.run(execute)          # the loop of rounds: the simulator, the benchmarks
    session.step(execute)         # one round (benchmarks alternate runs round by round)
    plan = session.next_plan(); ...; session.finish(plan, results)   # whoever acts in between

where ``execute(jobs, round) -> results`` runs client jobs (an engine, or Flower messages). ``step``
takes each result as it comes (an engine's ``stream``), so a round of many clients holds only those in
flight (``driver.OpenRound``). The Flower strategy plans the round Flower's loop names
(``driver.plan``, ``driver.plan_final``) and hands the replies to ``session.finish``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..algorithms import ClientSummary
from ..engines.base import ClientJob, ClientResult, Engine, RoundSetup
from ..functional import Params
from .checkpoint import load_checkpoint
from .driver import Callback, RoundDriver, RoundPlan, RunState, StopRule
from .state_store import ClientStore

RunJobs = Callable[[list[ClientJob], int], Iterable[ClientResult]]


def on_engine(engine: Engine, setup: RoundSetup) -> RunJobs:
    """``execute`` for a session whose rounds run on ``engine`` (the simulator, the benchmarks):
    its results streamed."""
    return lambda jobs, round: engine.stream(setup, jobs, round)


class RunSession:
    """One run: ``driver`` plans and finishes its rounds on ``state``; ``callbacks`` see every
    record, and those that are ``StopRule``s may end training early."""

    def __init__(
        self,
        driver: RoundDriver,
        state: RunState,
        callbacks: Sequence[Callback] = (),
        sizes: Mapping[int, int] | None = None,
    ) -> None:
        """``sizes``: each client's training-set size (from its summary), which lets ``step`` fold
        uploads in as they arrive."""
        self.driver = driver
        self.state = state
        self.callbacks = list(callbacks)
        self.sizes = sizes

    @classmethod
    def open(
        cls,
        driver: RoundDriver,
        init: Params,
        summaries: list[ClientSummary],
        *,
        checkpoint: Path | None = None,
        store: ClientStore | None = None,
        client_states: bool = True,
        device: torch.device | str = "cpu",
        callbacks: Sequence[Callback] = (),
    ) -> RunSession:
        """The run continued from ``checkpoint`` where that file exists, else started from ``init``.
        ``store`` keeps the clients (default: in memory; ``client_states`` False: they live with the
        clients, as on Flower nodes)."""
        if checkpoint is not None and checkpoint.is_file():
            state = load_checkpoint(checkpoint, device, store)
        else:
            if store is not None:
                store.prune()  # files of a run killed before its first checkpoint
            state = driver.start(init, summaries, client_states=client_states, store=store)
        return cls(driver, state, callbacks, {s.client_id: s.num_train for s in summaries})

    @property
    def done(self) -> bool:
        return self.state.done

    def stop_reason(self) -> str | None:
        """Why a stop rule among the callbacks ends training now (the first that does), or None."""
        for callback in self.callbacks:
            if isinstance(callback, StopRule) and (reason := callback.stop_reason(self.state)) is not None:
                return reason
        return None

    def training_over(self) -> bool:
        """Whether the next round is the final evaluation: every round trained, or a stop rule says so."""
        return not self.state.done and (self.state.rounds_done >= self.driver.rounds or self.stop_reason() is not None)

    def next_plan(self) -> RoundPlan | None:
        """The next training round, the final evaluation after the last one (or once a stop rule
        ends training), or None when done."""
        return self.driver.next_plan(self.state, self.stop_reason())

    def finish(self, plan: RoundPlan, results: Sequence[ClientResult]) -> dict[str, Any]:
        """Hand a round's results to the driver and its record to every callback."""
        return self._recorded(self.driver.finish(self.state, plan, results))

    def step(self, execute: RunJobs) -> dict[str, Any] | None:
        """Run the next round (its evaluation-only clients too) with ``execute``, taking each result
        as it comes; its record, or None when the run is done."""
        plan = self.next_plan()
        if plan is None:
            return None
        round = self.driver.open_round(self.state, plan, self.sizes)
        for jobs in (plan.jobs, plan.eval_jobs, plan.newcomer_jobs):
            if jobs:
                for result in execute(jobs, plan.round):
                    round.add(result)
        return self._recorded(round.close())

    def _recorded(self, record: dict[str, Any]) -> dict[str, Any]:
        for callback in self.callbacks:
            callback.on_record(self.state, record)
        return record

    def run(self, execute: RunJobs) -> RunState:
        """Every remaining round, the final evaluation included."""
        while self.step(execute) is not None:
            pass
        return self.state

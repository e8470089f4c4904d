"""The experiment loop, once for every backend: every seed x algorithm into one results folder.

A :class:`Backend` (the simulator, or Flower) says how one seed is set up (its Theta^0, the clients' summaries, the
partition) and how the rounds of one run execute (the simulator's engines, or Flower). The loop
around them is here: checkpoints (a run restarts from its last one), metrics, progress, the
partition and accuracy plots, the summary and the run status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from ..algorithms import Algorithm, ClientSummary
from ..config import BaseConfig
from ..functional import Params
from ..methods import REGISTRY, build_algorithm
from ..models import Units
from .checkpoint import Checkpointer, TraceWriter
from .driver import Callback, Plateau, RoundDriver, RunState
from .evaluation import GlobalEvaluation
from .newcomers import Newcomers
from .reliability import planned_steps, reliability_of
from .results import MetricsWriter, ResultsFolder, TensorBoardTracker
from .session import RunSession
from .state_store import DiskStateStore
from .stopping import reset_stop, stop_reason


@dataclass
class SeedStart:
    """What the runs of one seed start from."""

    init: Params
    units: Units
    summaries: list[ClientSummary]
    partition_seed: int
    partition: dict[str, Any] = field(default_factory=dict)  # the record kept in partition-seed<k>.json
    partition_title: str = ""
    global_evaluation: GlobalEvaluation | None = None  # the official protocol's global test set

    @property
    def counts(self) -> np.ndarray:
        return np.stack([s.label_counts for s in self.summaries])


def tta_bases(algorithms: Sequence[str]) -> dict[str, str]:
    """Methods of the run with a time-to-accuracy base (``Algorithm.tta_base``) also in the run."""
    out = {}
    for name in algorithms:
        resolved = REGISTRY.resolve(name)
        base = resolved.cls.tta_base
        if base is not None and base in algorithms and not resolved.modifiers:
            out[name] = base
    return out


class Backend(Protocol):
    """Runs the rounds of one (algorithm, seed): the simulator's engines or a Flower grid."""

    keeps_client_states: bool  # False: client states live with the clients (Flower nodes)
    device: torch.device

    def setup_seed(self, seed: int) -> SeedStart: ...

    def run(self, session: RunSession) -> None:
        """Run the session's remaining rounds (its callbacks see every record) until it is done."""


class ProgressBar:
    """Callback: one progress bar per run, advanced by every training round."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def on_record(self, state: RunState, record: dict[str, Any]) -> None:
        if not state.done:  # every record but the final one closes a training round
            self.bar.update(1)
        if "accuracy" in record:
            self.bar.set_postfix(acc=f"{100 * record['accuracy']:.2f}%")


def client_store(
    config: BaseConfig,
    results: ResultsFolder,
    name: str,
    algorithm: Algorithm,
    init: Params,
    seed: int,
    device: torch.device,
) -> DiskStateStore:
    """The disk store of run (``name``, ``seed``); a client's first state is ``init_client``'s."""
    clients = config.partition.num_clients
    trained = clients - len(config.unseen_client_ids())
    per_round = max(1, int(config.run.join_ratio * trained))
    return DiskStateStore(
        results.states_path(name, seed),
        clients,
        lambda i: algorithm.init_client(init, i),
        cache=config.run.state_cache or min(per_round, 64),
        device=device,
    )


def plateau_rule(config: BaseConfig, algorithm: Algorithm) -> Plateau | None:
    """The run's convergence rule (``plateau_*`` of ``[run]``), if any; it waits for the end of the
    method's own schedule (APPLE's lambda(r)), which a plateau before it would cut short."""
    run = config.run
    if run.plateau_evaluations is None:
        return None
    metric = run.plateau_metric
    if metric == "global_accuracy" and not algorithm.has_global_model:
        metric = "accuracy"
    return Plateau(run.plateau_evaluations, run.plateau_points, metric, not_before=algorithm.schedule_rounds())


def newcomers(config: BaseConfig, init: Params | None) -> Newcomers | None:
    """The run's unseen clients (``[run] unseen_clients``, and the clients of ``data.heldout_domains``),
    None where every client trains; ``init``: the model their states start from (None where the
    clients build them: Flower)."""
    ids = config.unseen_client_ids()
    run = config.run
    if not ids:
        return None
    return Newcomers(tuple(ids), run.unseen_finetune_epochs, init, run.unseen_finetune_steps, run.unseen_finetune_lr)


def open_session(
    config: BaseConfig,
    results: ResultsFolder,
    backend: Backend,
    setup: SeedStart,
    name: str,
    algorithm: Algorithm,
    seed: int,
) -> RunSession:
    """The run (``name``, ``seed``) of ``config``: continued from its checkpoint in ``results``
    where one exists, its clients in the configured store (on Flower: with the nodes)."""
    driver = RoundDriver(
        algorithm,
        num_clients=config.partition.num_clients,
        seed=seed,
        rounds=config.train.rounds,
        join_ratio=config.run.join_ratio,
        eval_every=config.run.eval_every,
        global_evaluation=setup.global_evaluation,
        local_test=config.partition.official,
        evaluate_all=config.run.eval_all_clients,
        newcomers=newcomers(config, setup.init if backend.keeps_client_states else None),
        reliability=reliability_of(
            config.run,
            config.partition.num_clients,
            planned_steps(config.train, {s.client_id: s.num_train for s in setup.summaries}),
        ),
        records_drops=config.run.tolerate_failures,
    )
    store = None
    if config.run.state_store == "disk" and backend.keeps_client_states:
        store = client_store(config, results, name, algorithm, setup.init, seed, backend.device)
    session = RunSession.open(
        driver,
        setup.init,
        setup.summaries,
        checkpoint=results.checkpoint_path(name, seed),
        store=store,
        client_states=backend.keeps_client_states,
        device=backend.device,
    )
    results.check_checkpoint(session.state, name, seed)
    if session.state.config_sha256 is None:  # a new run (or one checkpointed by an older release)
        session.state.config_sha256 = results.config_sha256()
    return session


def outputs(
    config: BaseConfig, results: ResultsFolder, backend: Backend, name: str, algorithm: Algorithm, seed: int, bar: Any
) -> list[Callback]:
    """What watches a run's records: its checkpoints, metrics.jsonl, the progress bar, the
    configured traces and trackers, and the plateau rule that may end it."""
    callbacks: list[Callback] = [
        Checkpointer(results.checkpoint_path(name, seed), config.run.checkpoint_every),
        MetricsWriter(results),
        ProgressBar(bar),
    ]
    rule = plateau_rule(config, algorithm)
    if rule is not None:
        callbacks.append(rule)
    if config.trace.clients and backend.keeps_client_states:
        callbacks.append(TraceWriter(results.root / "trace", algorithm, config.trace.clients))
    if config.run.tracker == "tensorboard":
        callbacks.append(TensorBoardTracker(results.root / "tensorboard", name, seed))
    return callbacks


class Summarizer(Protocol):
    """The figures and the summary of a run (``reporting.RunSummarizer``; federation draws nothing)."""

    def partition(self, counts: np.ndarray, path: Path, title: str, domains: Sequence[str] = ()) -> None:
        """The clients' label counts (``domains``: each client's domain label, under feature shift)."""

    def server_state(self, name: str, seed: int, server: Mapping[str, Any], plots: Path) -> None:
        """Figures of a finished run's server state (drawn for the first seed)."""

    def finish(
        self,
        histories: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]],
        algorithms: Sequence[str],
        seeds: Sequence[int],
        tta_bases: Mapping[str, str],
        plots: Path,
        title: str,
        official: bool,
    ) -> dict[str, Any]: ...


def run_all(
    config: BaseConfig,
    results: ResultsFolder,
    backend: Backend,
    summarizer: Summarizer,
    *,
    progress: bool = True,
    callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Every algorithm x seed of ``config`` (continuing from the folder's checkpoints); returns
    the summary (made and drawn by ``summarizer``), written last with the status ``complete``
    (``failed`` with the error, or ``interrupted`` with the resume command, otherwise)."""
    reset_stop()
    try:
        histories: dict[tuple[str, int], list[dict[str, Any]]] = {}
        extras: dict[str, dict[str, Any]] = {}  # what a method reports once per run (Algorithm.summary_metrics)
        plotted: set[int] = set()
        for seed in config.seeds:
            setup = backend.setup_seed(seed)
            if setup.partition_seed not in plotted:
                plotted.add(setup.partition_seed)
                results.write_partition(setup.partition_seed, setup.partition)
                summarizer.partition(
                    setup.counts,
                    results.plots / f"partition-seed{setup.partition_seed}.png",
                    setup.partition_title,
                    [d["label"] for d in setup.partition.get("domains", [])],
                )
            for name in config.algorithms:
                algorithm = build_algorithm(name, config.algorithm_sections(), config.train, setup.units)
                extras[name] = algorithm.summary_metrics(setup.init)
                session = open_session(config, results, backend, setup, name, algorithm, seed)
                if not session.done:
                    bar = tqdm(
                        total=config.train.rounds,
                        initial=session.state.rounds_done,
                        desc=f"{name} seed {seed}",
                        disable=not progress,
                        leave=True,
                        dynamic_ncols=True,
                    )
                    with bar if progress else nullcontext():
                        session.callbacks = [*outputs(config, results, backend, name, algorithm, seed, bar), *callbacks]
                        backend.run(session)
                state = session.state
                histories[(name, seed)] = state.history
                if seed == config.seeds[0]:
                    summarizer.server_state(name, seed, state.server, results.plots)
        summary = summarizer.finish(
            histories,
            config.algorithms,
            config.seeds,
            tta_bases(config.algorithms),
            results.plots,
            f"{config.dataset}, {config.partition.method}, {config.partition.num_clients} clients",
            official=config.partition.official,
        )
        for name, values in extras.items():
            summary[name].update(values)
        results.write_summary(summary)
        results.set_status("complete")
    except BaseException as exc:
        # a stop signal that landed inside a C++ call (torch.save) surfaces as another exception
        if isinstance(exc, KeyboardInterrupt) or stop_reason() is not None:
            reason = stop_reason() or str(exc) or "interrupted (Ctrl-C)"
            results.set_status("interrupted", error=reason, resume=f"pflkit run --resume {results.root}")
            raise RunInterrupted(reason, results.root) from None
        results.set_status("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    return summary


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run; its folder (``folder``) is marked ``interrupted`` and
    continues from its last checkpoints with ``pflkit run --resume``."""

    def __init__(self, reason: str, folder: Path) -> None:
        super().__init__(reason)
        self.reason, self.folder = reason, folder

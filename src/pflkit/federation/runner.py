"""The experiment loop, once for every executor: every seed x algorithm into one results folder.

An :class:`Executor` says how one seed is set up (its Theta^0, the clients' summaries, the
partition) and how the rounds of one run execute (the simulator's engines, or Flower). The loop
around them is here: checkpoints (a run restarts from its last one), metrics, progress, the
partition and accuracy plots, the summary and the run status.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..algorithms import ALGORITHMS, Algorithm, ClientSummary, build_algorithm, parse_name
from ..config import BaseConfig
from ..functional import Params
from ..models import Units
from .checkpoint import Checkpointer, TraceWriter, load_checkpoint
from .driver import Callback, RoundDriver, RunState
from .evaluation import GlobalEvaluation
from .results import MetricsWriter, ResultsFolder, TensorBoardTracker
from .state_store import DiskStateStore
from .stopping import reset_stop, stop_reason


@dataclass
class SeedSetup:
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
        base = ALGORITHMS[parse_name(name)[0]].tta_base
        if base is not None and base in algorithms and not parse_name(name)[1]:
            out[name] = base
    return out


class Executor(Protocol):
    """Runs the rounds of one (algorithm, seed): the simulator's engines or a Flower grid."""

    keeps_client_states: bool  # False: client states live with the clients (Flower nodes)
    device: torch.device

    def setup_seed(self, seed: int) -> SeedSetup: ...

    def run(self, driver: RoundDriver, state: RunState, callbacks: Sequence[Callback]) -> None:
        """Execute ``driver``'s plans on ``state`` until it is done, calling ``callbacks`` with
        every record."""


class ProgressBar:
    """Callback: one progress bar per run, advanced by every training round."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def on_record(self, state: RunState, record: dict[str, Any]) -> None:
        if not state.done:  # every record but the final one closes a training round
            self.bar.update(1)
        if "accuracy" in record:
            self.bar.set_postfix(acc=f"{100 * record['accuracy']:.2f}%")


def client_store(config: BaseConfig, results: ResultsFolder, name: str, algorithm: Algorithm, init: Params,
                 seed: int, device: torch.device) -> DiskStateStore:
    """The disk store of run (``name``, ``seed``); a client's first state is ``init_client``'s."""
    clients = config.partition.num_clients
    per_round = max(1, int(config.run.join_ratio * clients))
    return DiskStateStore(results.states_path(name, seed), clients,
                          lambda i: algorithm.init_client(init, i), cache=config.run.state_cache or per_round,
                          device=device)


class Report(Protocol):
    """The figures and the summary of a run (``reporting.RunReport``; federation draws nothing)."""

    def partition(self, counts: np.ndarray, path: Path, title: str) -> None: ...

    def simplex(self, simplex: Mapping[str, Any], path: Path, title: str) -> None: ...

    def finish(self, histories: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]], algorithms: Sequence[str],
               seeds: Sequence[int], tta_bases: Mapping[str, str], plots: Path, title: str,
               official: bool) -> dict[str, Any]: ...


def run_all(config: BaseConfig, results: ResultsFolder, executor: Executor, report: Report, *,
            progress: bool = True, callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Every algorithm x seed of ``config`` (continuing from the folder's checkpoints); returns
    the summary (made and drawn by ``report``), written last with the status ``complete``
    (``failed`` with the error, or ``interrupted`` with the resume command, otherwise)."""
    reset_stop()
    try:
        histories: dict[tuple[str, int], list[dict[str, Any]]] = {}
        ala_weights: dict[str, int] = {}
        plotted: set[int] = set()
        for seed in config.seeds:
            setup = executor.setup_seed(seed)
            if setup.partition_seed not in plotted:
                plotted.add(setup.partition_seed)
                results.write_partition(setup.partition_seed, setup.partition)
                report.partition(setup.counts, results.plots / f"partition-seed{setup.partition_seed}.png",
                                 setup.partition_title)
            for name in config.algorithms:
                algorithm = build_algorithm(name, config.algorithm_sections(), config.train, setup.units)
                if hasattr(algorithm, "num_ala_weights"):  # X+ala: the size of what ALA learns
                    ala_weights[name] = algorithm.num_ala_weights(setup.init)
                driver = RoundDriver(algorithm, num_clients=config.partition.num_clients, seed=seed,
                                     rounds=config.train.rounds, join_ratio=config.run.join_ratio,
                                     eval_every=config.run.eval_every, global_evaluation=setup.global_evaluation,
                                     local_test=config.partition.official, evaluate_all=config.run.eval_all_clients)
                ckpt = results.checkpoint_path(name, seed)
                store = None
                if config.run.state_store == "disk" and executor.keeps_client_states:
                    store = client_store(config, results, name, algorithm, setup.init, seed, executor.device)
                state = load_checkpoint(ckpt, executor.device) if ckpt.is_file() else None
                if state is None:
                    if store is not None:
                        store.prune()  # files of a run killed before its first checkpoint
                    state = driver.start(setup.init, setup.summaries, client_states=executor.keeps_client_states,
                                         store=store)
                elif state.client_store is not None:
                    if store is None:
                        raise RuntimeError(f"checkpoint {ckpt} keeps its clients on disk but this run does not "
                                           "(state_store changed)")
                    try:
                        state.clients = store.restore(state.client_store)
                    except FileNotFoundError as exc:
                        raise FileNotFoundError(f"{exc}. Copy them back, or delete {ckpt} to run {name} seed {seed} "
                                                "again from round 0") from None
                if not state.done:
                    bar = tqdm(total=config.train.rounds, initial=state.rounds_done, desc=f"{name} seed {seed}",
                               disable=not progress, leave=True, dynamic_ncols=True)
                    with bar if progress else nullcontext():
                        tracers: list[Callback] = [TraceWriter(results.root / "trace", algorithm, config.trace.clients)
                                                   ] if config.trace.clients and executor.keeps_client_states else []
                        if config.run.tracker == "tensorboard":
                            tracers.append(TensorBoardTracker(results.root / "tensorboard"))
                        executor.run(driver, state, [Checkpointer(ckpt, config.run.checkpoint_every),
                                                     MetricsWriter(results), ProgressBar(bar), *tracers, *callbacks])
                histories[(name, seed)] = state.history
                if seed == config.seeds[0] and "simplex" in state.server:
                    report.simplex(state.server["simplex"], results.plots / f"simplex-{name}.png",
                                   f"{name}: clients' LDA points and cluster subregions (seed {seed})")
        summary = report.finish(histories, config.algorithms, config.seeds, tta_bases(config.algorithms),
                                results.plots, f"{config.dataset}, {config.partition.method}, "
                                f"{config.partition.num_clients} clients", official=config.partition.official)
        for name, count in ala_weights.items():
            summary[name]["ala_weights"] = count
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

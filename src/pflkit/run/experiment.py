"""The simulator: run a whole experiment on this machine with one of the engines.

``run_experiment`` partitions the data, checks that every algorithm fits the model, and hands
the experiment loop (``pflkit.federation.runner``) a backend (``Simulator``) that runs each round's client jobs
on the configured engine.
"""

from __future__ import annotations

import datetime as dt
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..algorithms import ClientSummary
from ..config import BaseConfig, ConfigError, to_dict
from ..data.federated import FederatedData
from ..data.partition.words import partition_words
from ..engines import Engine, RoundSetup, build_engine
from ..federation import (
    Callback,
    GlobalEvaluation,
    ResultsFolder,
    RunSession,
    SeedStart,
    build_partitions,
    initial_params,
    partition_seed,
    resolve_device,
    run_all,
)
from ..federation.evaluation import local_model_metrics
from ..federation.session import on_engine
from ..methods import build_algorithm
from ..models import UnitModel
from ..reporting import RunSummarizer, format_table
from ..reporting.paper import paper_cell
from .next_steps import run_lines

#: how the clients of the datasets that arrive with them were made (the partition's place in the log)
NATURAL_KINDS = {
    "pfllib": "PFLlib's own",
    "femnist": "LEAF's users",
    "shakespeare": "LEAF's users",
    "sent140": "LEAF's users",
    "leaf": "the JSON's users",
    "fedprox_synthetic": "Synthetic(alpha, beta)",
    "digit5": "per-domain",
    "office_caltech10": "per-domain",
    "domainnet": "per-domain",
}

log = logging.getLogger(__name__)


class Simulator:
    """Backend: the rounds run in this process on ``engine`` over in-memory partitions."""

    keeps_client_states = True

    def __init__(
        self, config: BaseConfig, partitions: dict[int, FederatedData], engine: Engine, device: torch.device
    ) -> None:
        self.config = config
        self.partitions = partitions
        self.engine = engine
        self.device = device
        self._seeds: dict[int, tuple[FederatedData, UnitModel]] = {}

    def setup_seed(self, seed: int) -> SeedStart:
        pseed = partition_seed(self.config, seed)
        data = self.partitions[pseed]
        model, init = initial_params(self.config, data, seed, self.device)
        self._seeds[seed] = (data, model)
        summaries = [
            ClientSummary(i, data.clients[i].num_train, data.train_label_counts(i)) for i in range(data.num_clients)
        ]
        kind = NATURAL_KINDS.get(self.config.dataset) or partition_words(self.config.partition)
        test = data.global_test
        evaluation = (
            None
            if test is None
            else GlobalEvaluation(
                model,
                *test,
                data.num_classes,
                np.stack([data.prior(i) for i in range(data.num_clients)]),
                self.config.train.eval_batch_size,
                workers=getattr(self.engine, "workers", 1),
            )
        )
        return SeedStart(
            init,
            model.units(),
            summaries,
            pseed,
            data.partition_record(),
            f"{self.config.dataset}: {kind} partition, {self.config.partition.num_clients} clients (seed {pseed})",
            evaluation,
        )

    def run(self, session: RunSession) -> None:
        driver = session.driver
        data, model = self._seeds[driver.seed]
        setup = RoundSetup(
            driver.algorithm,
            data,
            model,
            model.units(),
            self.config.train,
            driver.seed,
            local_model_metrics(self.config.metrics),
        )
        session.run(on_engine(self.engine, setup))


def run_experiment(
    config: BaseConfig,
    out: str | Path | None,
    *,
    resume: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) ``config`` into folder ``out``; return the summary.

    ``out=None``: a new folder ``results/<name>-<timestamp>`` (``-2``, ``-3``... when another
    run took that name first). The folder is locked while the run writes it: a second process
    is refused. ``callbacks`` see every record after the results folder did (tests stop runs with them).
    """
    torch.set_num_threads(config.run.threads)
    device = resolve_device(config.run.device)
    # Data and model problems surface before the results folder is created.
    config, partitions = build_partitions(config, device)
    check_fits(config, partitions[partition_seed(config, config.seeds[0])])
    results = ResultsFolder(out if out is not None else new_results_folder(config.name))
    with results.locked():
        if resume:
            results.check_resumable()
            if results.status()["status"] == "complete" and results.has_summary():
                summary = results.summary()  # nothing left to run: the records stay as they are
                echo(f"{results.root} holds a complete run: nothing to resume")
                echo(format_table(summary))
                echo("\n".join(run_lines(results.root, config)))
                return summary
            # checked against metrics.jsonl before a byte of it is rewritten
            results.rewrite_metrics(results.saved_histories(config.algorithms, config.seeds))
            results.set_status("running")
        else:
            results.create(to_dict(config))
        engine = build_engine(config.run.engine, workers=config.run.workers, device=device.type)
        try:
            summary = run_all(
                config,
                results,
                Simulator(config, partitions, engine, device),
                RunSummarizer(),
                progress=progress,
                callbacks=callbacks,
            )
        finally:
            engine.close()
    echo(format_table(summary))
    echo("\n".join(run_lines(results.root, config)))
    return summary


def check_fits(config: BaseConfig, data: FederatedData) -> None:
    """Before anything is written: every algorithm's settings fit the model on ``data`` (``fedala.p``
    beyond the model's units fails here) and ``paper_table`` names a table pflkit ships."""
    if config.paper_table:
        try:
            paper_cell(config.paper_table)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    largest = max(data.client(i).num_train for i in range(data.num_clients))
    if config.train.batch_size > largest:
        raise ConfigError(
            f"batch_size = {config.train.batch_size} exceeds every client's training set (the largest "
            f"holds {largest} samples); for full-batch steps set batch_size = {largest}"
        )
    model = initial_params(config, data, config.seeds[0], torch.device("cpu"))[0]
    for name in config.algorithms:
        try:
            algorithm = build_algorithm(name, config.algorithm_sections(), config.train, model.units())
            algorithm.check_model(model)
        except ValueError as exc:  # a model without the parts the method needs: name the model too
            raise ConfigError(f"{exc} (model = {config.model_for(tuple(data.input_shape))!r})") from None


def new_results_folder(name: str, parent: Path = Path("results")) -> Path:
    """A folder no other run has: ``<parent>/<name>-<timestamp>``, created here (atomically, so
    two runs started in the same second get two folders)."""
    stem = f"{name}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    parent.mkdir(parents=True, exist_ok=True)
    for k in itertools.count(1):
        folder = parent / (stem if k == 1 else f"{stem}-{k}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def resume_experiment(out: str | Path, **kwargs: Any) -> dict[str, Any]:
    """Continue the run saved in ``out`` with its own resolved config."""
    results = ResultsFolder(out)
    results.check_resumable()
    try:
        config = results.load_config()
    except ConfigError as exc:
        raise ConfigError(f"cannot resume {results.root}: its config.toml does not load: {exc}") from None
    return run_experiment(config, out, resume=True, **kwargs)

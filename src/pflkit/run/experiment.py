"""Run a whole experiment: every algorithm x seed on the same partition, into one results folder."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from ..algorithms import TrainSettings, build_algorithm
from ..config import BaseConfig, ConfigError, load_config, to_dict
from ..data import Dataset, PartitionSpec, load_dataset, load_pfllib
from ..data.federated import FederatedData
from ..engines import RoundSetup, build_engine
from ..functional import stream_seed
from ..models import buffer_names, build_model
from ..reporting import format_table, plot_accuracy, plot_partition, summarize
from .checkpoint import Checkpointer, load_checkpoint
from .results import ResultsFolder
from .rounds import RunState, run_rounds, start_run

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} was requested but CUDA is not available on this machine")
    return device


def initial_params(config: BaseConfig, data: FederatedData | tuple[Any, ...], seed: int,
                   device: torch.device) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model skeleton and Theta^0, seeded by the run seed (same for every algorithm).

    ``data`` is a FederatedData or (input shape, number of classes[, vocabulary size]). Built on
    the CPU from a seeded generator, Theta^0 is identical on every machine with the same PyTorch
    version, which lets Flower nodes build it locally. Theta^0 holds the parameters and the
    floating buffers (batch-norm running statistics) under their state-dict names.
    """
    if isinstance(data, FederatedData):
        shape, classes, vocab_size = data.input_shape, data.num_classes, data.vocab_size
    else:
        shape, classes, vocab_size = data[0], data[1], (data[2] if len(data) > 2 else None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(seed, "model-init"))
        model = build_model(config.model_for(tuple(shape)), tuple(shape), classes, vocab_size=vocab_size)
    model = model.to(device)
    buffers = dict(model.named_buffers())
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    init.update({k: buffers[k].detach().clone() for k in buffer_names(model)})
    return model, init


class _Recorder:
    """Callback: append records to metrics.jsonl and advance the progress bar."""

    def __init__(self, results: ResultsFolder, bar: Any) -> None:
        self.results = results
        self.bar = bar

    def on_record(self, state: RunState, record: dict[str, Any]) -> None:
        self.results.append_record(record)
        if not state.done:  # every record but the final one closes a training round
            self.bar.update(1)
        if "accuracy" in record:
            self.bar.set_postfix(acc=f"{100 * record['accuracy']:.2f}%")


def _build_partitions(config: BaseConfig, device: torch.device) -> dict[int, FederatedData]:
    """One partition of the pooled dataset per distinct partition seed."""
    dataset = load_dataset(config.dataset, config.data_dir)
    partitions: dict[int, FederatedData] = {}
    for seed in config.seeds:
        pseed = seed if config.partition_seed is None else config.partition_seed
        if pseed not in partitions:
            partitions[pseed] = partition_dataset(config, dataset, pseed, device)
    return partitions


def partition_spec(config: BaseConfig) -> PartitionSpec:
    """The partition keys of ``config``."""
    return PartitionSpec(method=config.partition, num_clients=config.num_clients, alpha=config.alpha,
                         classes_per_client=config.classes_per_client, balanced=config.balanced,
                         min_samples_per_client=config.min_samples_per_client, balance_cap=config.balance_cap,
                         train_fraction=config.train_fraction, batch_size=config.batch_size,
                         rng=config.partition_rng)


def partition_dataset(config: BaseConfig, dataset: Dataset, partition_seed: int,
                      device: torch.device | str) -> FederatedData:
    """The config's partition of ``dataset`` for one partition seed (simulator and Flower nodes)."""
    return FederatedData.build(dataset, partition_spec(config), partition_seed, device=device)


def _pfllib_partitions(config: BaseConfig, device: torch.device) -> tuple[BaseConfig, dict[int, FederatedData]]:
    """The PFLlib folder's own client splits for every seed, and the config with its client count adopted.

    The folder fixes the clients, so the partition keys (partition, alpha, ...) are ignored; a
    different ``num_clients`` is replaced by the folder's so that the saved config tells the truth.
    """
    data = load_pfllib(config.data_dir, device=device)
    log.info("dataset pfllib: using the %d client splits of %s; partition, alpha, classes_per_client, "
             "balanced, min_samples_per_client, train_fraction and partition_seed are ignored",
             data.num_clients, config.data_dir)
    if data.num_clients != config.num_clients:
        log.warning("num_clients=%d replaced by the %d clients of %s/config.json", config.num_clients,
                    data.num_clients, config.data_dir)
        config = config.model_copy(update={"num_clients": data.num_clients})
    seeds = {seed if config.partition_seed is None else config.partition_seed for seed in config.seeds}
    return config, {pseed: data for pseed in seeds}


def run_experiment(config: BaseConfig, out: str | Path, *, resume: bool = False, progress: bool = True,
                   echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) ``config`` into folder ``out``; return the summary."""
    results = ResultsFolder(out)
    torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    # Data problems surface before the results folder is created.
    if config.dataset == "pfllib":
        config, partitions = _pfllib_partitions(config, device)
    else:
        partitions = _build_partitions(config, device)
    train = TrainSettings.from_config(config)
    first = partitions[config.seeds[0] if config.partition_seed is None else config.partition_seed]
    units = initial_params(config, first, config.seeds[0], device)[0].units()
    for name in config.algorithms:  # settings that do not fit the model (fedala.p) fail before any output
        build_algorithm(name, config.algorithm_sections(), train, units)
    if resume:
        results.rewrite_metrics(results.saved_histories(config.algorithms, config.seeds))
        results.set_status("running")
    else:
        results.create(to_dict(config))
    engine = None
    try:
        for pseed, data in partitions.items():
            results.write_partition(pseed, data.partition_record())
            path = results.plots / f"partition-seed{pseed}.png"
            if not path.exists():
                kind = "PFLlib's own" if config.dataset == "pfllib" else config.partition
                plot_partition(data.counts, path, f"{config.dataset}: {kind} partition, "
                               f"{config.num_clients} clients (seed {pseed})")
        engine = build_engine(config.engine, workers=config.workers, device=device.type)
        histories: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for seed in config.seeds:
            data = partitions[seed if config.partition_seed is None else config.partition_seed]
            model, init = initial_params(config, data, seed, device)
            units = model.units()
            for name in config.algorithms:
                ckpt = results.checkpoint_path(name, seed)
                state = load_checkpoint(ckpt, device) if ckpt.is_file() else None
                if state is None or not state.done:
                    algorithm = build_algorithm(name, config.algorithm_sections(), train, units)
                    setup = RoundSetup(algorithm, data, model, units, train, seed)
                    state = state or start_run(setup, init)
                    bar = tqdm(total=config.rounds, initial=state.rounds_done, desc=f"{name} seed {seed}",
                               disable=not progress, leave=True, dynamic_ncols=True)
                    with bar if progress else nullcontext():
                        state = run_rounds(setup, engine, state, rounds=config.rounds,
                                           join_ratio=config.join_ratio, eval_every=config.eval_every,
                                           callbacks=[Checkpointer(ckpt, config.checkpoint_every),
                                                      _Recorder(results, bar)])
                histories[(name, seed)] = state.history
        summary = summarize(histories, config.algorithms, config.seeds)
        plot_accuracy(histories, results.plots / "accuracy.png",
                      f"{config.dataset}, {config.partition}, {config.num_clients} clients")
        results.write_summary(summary)
        results.set_status("complete")
    except BaseException as exc:
        results.set_status("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if engine is not None:
            engine.close()
    echo(format_table(summary))
    echo(f"results: {results.root}")
    return summary


def resume_experiment(out: str | Path, **kwargs: Any) -> dict[str, Any]:
    """Continue the run saved in ``out`` with its own resolved config."""
    results = ResultsFolder(out)
    results.check_resumable()
    try:
        config = load_config(results.config_path)
    except ConfigError as exc:
        raise ConfigError(f"cannot resume {results.root}: its config.toml does not load: {exc}") from None
    return run_experiment(config, out, resume=True, **kwargs)

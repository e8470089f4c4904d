"""Run a pflkit experiment on Flower: every algorithm x seed, into the simulator's results folder."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from ..algorithms import ClientSummary, TrainSettings, build_algorithm
from ..config import BaseConfig, to_dict
from ..reporting import format_table, plot_accuracy, plot_partition, summarize
from ..run.experiment import initial_params, resolve_device
from ..run.checkpoint import Checkpointer, load_checkpoint
from ..run.results import MetricsWriter, ResultsFolder
from ..run.rounds import RunState
from .resilient import ResilientGrid
from .strategy import PflkitStrategy

log = logging.getLogger(__name__)


def discover(grid: Grid, config: BaseConfig, config_text: str, seed: int,
             wait_seconds: float = 120.0) -> tuple[dict[int, int], list[ClientSummary], dict[str, Any]]:
    """Wait for ``num_clients`` nodes, ask each who it is; return client->node ids and summaries."""
    deadline = time.time() + wait_seconds
    while len(node_ids := list(grid.get_node_ids())) < config.num_clients:
        if time.time() > deadline:
            raise RuntimeError(f"only {len(node_ids)} of {config.num_clients} SuperNodes connected "
                               f"within {wait_seconds:.0f} s")
        time.sleep(1.0)
    content = RecordDict({"pflkit": ConfigRecord({"config": config_text, "seed": seed})})
    messages = [Message(content, dst_node_id=n, message_type=MessageType.QUERY, group_id="query") for n in node_ids]
    replies = list(grid.send_and_receive(messages, timeout=wait_seconds))
    errors = [r.error.reason for r in replies if r.has_error()]
    if errors:
        raise RuntimeError(f"a SuperNode could not set up its client: {errors[0]}")
    nodes: dict[int, int] = {}
    summaries = []
    info: dict[str, Any] = {}
    for reply in replies:
        rec = reply.content["pflkit"]
        cid = int(rec["client-id"])
        if cid in nodes:
            raise RuntimeError(f"two SuperNodes claim partition-id {cid}")
        nodes[cid] = reply.metadata.src_node_id
        summaries.append(ClientSummary(cid, int(rec["num-train"]), np.array(list(rec["label-counts"]))))
        info = {"input_shape": tuple(int(s) for s in rec["input-shape"]), "num_classes": int(rec["num-classes"]),
                "vocab_size": int(rec["vocab-size"]) or None}
    missing = sorted(set(range(config.num_clients)) - set(nodes))
    if missing:
        raise RuntimeError(f"no SuperNode holds client(s) {missing}; check each node's partition-id")
    return nodes, sorted(summaries, key=lambda s: s.client_id), info


def run_on_flower(config: BaseConfig, grid: Grid, out: str | Path, *, timeout: float = 3600.0,
                  wait_seconds: float = 120.0) -> dict[str, Any]:
    """The Flower counterpart of ``run_experiment`` (same records, summary and plots).

    The server state, history and round are checkpointed in ``out`` after every
    ``checkpoint_every`` aggregations; started again with the same config and ``out`` (a
    restarted ServerApp), the run continues where it stopped.
    """
    grid = ResilientGrid(grid, wait_seconds)
    results = ResultsFolder(out)
    config_dict = to_dict(config)
    if results.start_or_resume(config_dict):
        log.info("continuing the unfinished run in %s from its checkpoints", results.root)
        results.rewrite_metrics(results.saved_histories(config.algorithms, config.seeds))
        results.set_status("running")
    config_text = tomli_w.dumps(config_dict)
    device = resolve_device("cpu")
    train = TrainSettings.from_config(config)
    histories: dict[tuple[str, int], list[dict[str, Any]]] = {}

    try:
        for seed in config.seeds:
            nodes, summaries, info = discover(grid, config, config_text, seed, wait_seconds)
            counts = np.stack([s.label_counts for s in summaries])
            plot_partition(counts, results.plots / f"partition-seed{seed}.png",
                           f"{config.dataset}: training labels per client on Flower (seed {seed})")
            model, init = initial_params(config, (info["input_shape"], info["num_classes"], info["vocab_size"]), seed,
                                         device)
            for name in config.algorithms:
                ckpt = results.checkpoint_path(name, seed)
                state = load_checkpoint(ckpt, device) if ckpt.is_file() else None
                algorithm = build_algorithm(name, config.algorithm_sections(), train, model.units())
                if state is None:
                    server = algorithm.prepare(algorithm.init_server(init), summaries)
                    state = RunState(algorithm=name, seed=seed, rounds_done=0, server=server, clients={})
                if not state.done:
                    strategy = PflkitStrategy(config, config_text, algorithm, state, nodes,
                                              callbacks=[Checkpointer(ckpt, config.checkpoint_every), MetricsWriter(results)])
                    strategy.start(grid, initial_arrays=ArrayRecord(torch_state_dict=init),
                                   num_rounds=config.rounds, timeout=timeout)
                if not state.done:
                    raise RuntimeError(f"{name} seed {seed}: the final evaluation did not run")
                histories[(name, seed)] = state.history
        summary = summarize(histories, config.algorithms, config.seeds)
        plot_accuracy(histories, results.plots / "accuracy.png", f"{config.dataset} on Flower")
        results.write_summary(summary)
        results.set_status("complete")
    except BaseException as exc:
        results.set_status("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    log.info("\n%s\nresults: %s", format_table(summary), results.root)
    return summary

"""Run a pflkit experiment on Flower: the shared experiment loop with a Flower backend."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from ..algorithms import ClientSummary
from ..config import BaseConfig, ConfigError, resolved, to_dict
from ..data import load_dataset
from ..data.domains import shift_test_set
from ..data.federated import official_split
from ..federation import (
    GlobalEvaluation,
    ResultsFolder,
    RunSession,
    SeedStart,
    initial_params,
    partition_seed,
    resolve_device,
    run_all,
)
from ..reporting import RunSummarizer, format_table
from .logs import client_error
from .resilient import ResilientGrid
from .strategy import PflkitStrategy

log = logging.getLogger(__name__)


def discover(
    grid: Grid,
    config: BaseConfig,
    config_text: str,
    seed: int,
    wait_seconds: float = 120.0,
    reply_timeout: float | None = None,
) -> tuple[dict[int, int], list[ClientSummary], dict[str, Any]]:
    """Wait for ``num_clients`` nodes, ask each who it is; return client->node ids and summaries.
    ``wait_seconds`` bounds the wait for the nodes to connect; ``reply_timeout`` (default: the
    config's ``[run] reply_timeout``) the wait for their answers, which load each client's data."""
    reply_timeout = config.run.reply_timeout if reply_timeout is None else reply_timeout
    deadline = time.time() + wait_seconds
    while len(node_ids := list(grid.get_node_ids())) < config.partition.num_clients:
        if time.time() > deadline:
            raise RuntimeError(
                f"only {len(node_ids)} of {config.partition.num_clients} SuperNodes connected "
                f"within {wait_seconds:.0f} s"
            )
        time.sleep(1.0)
    content = RecordDict({"pflkit": ConfigRecord({"config": config_text, "seed": seed})})
    messages = [Message(content, dst_node_id=n, message_type=MessageType.QUERY, group_id="query") for n in node_ids]
    replies = list(grid.send_and_receive(messages, timeout=reply_timeout))
    if len(replies) < len(messages):
        raise RuntimeError(
            f"only {len(replies)} of {len(messages)} SuperNodes answered the setup query within "
            f"{reply_timeout:.0f} s ([run] reply_timeout)"
        )
    errors = [r.error.reason for r in replies if r.has_error()]
    if errors:
        raise RuntimeError(f"a SuperNode could not set up its client: {client_error(errors[0])}")
    nodes: dict[int, int] = {}
    summaries = []
    info: dict[str, Any] = {}
    for reply in replies:
        rec: Mapping[str, Any] = reply.content["pflkit"]  # the ConfigRecord the client app wrote
        cid = int(rec["client-id"])
        if cid in nodes:
            raise RuntimeError(f"two SuperNodes claim partition-id {cid}")
        nodes[cid] = reply.metadata.src_node_id
        summaries.append(ClientSummary(cid, int(rec["num-train"]), np.array(list(rec["label-counts"]))))
        info = {
            "input_shape": tuple(int(s) for s in rec["input-shape"]),
            "num_classes": int(rec["num-classes"]),
            "vocab_size": int(rec["vocab-size"]) or None,
        }
    missing = sorted(set(range(config.partition.num_clients)) - set(nodes))
    if missing:
        raise RuntimeError(f"no SuperNode holds client(s) {missing}; check each node's partition-id")
    return nodes, sorted(summaries, key=lambda s: s.client_id), info


def check_flower_config(config: BaseConfig, simulation: bool = False) -> None:
    """Refuse the simulator-only keys before anything is written (``state_store = "disk"`` is
    Flower's Simulation Engine's too: its virtual SuperNodes share the results folder)."""
    if config.run.eval_all_clients:
        raise ConfigError(
            "eval_all_clients = true runs in the simulator only: on Flower only the sampled "
            "clients are reached each round; set eval_all_clients = false"
        )
    if config.trace.clients:
        raise ConfigError(
            "trace.clients runs in the simulator only: on Flower the client models stay on the "
            "nodes; set trace.clients = []"
        )
    if config.run.state_store == "disk" and not simulation:
        raise ConfigError(
            'state_store = "disk" runs in the simulator and on Flower\'s Simulation Engine only: in '
            "a deployment each node keeps its own client's state (its node config's state-dir); "
            'set state_store = "memory"'
        )
    if config.client_count() is None:  # a PFLlib or LEAF folder: one SuperNode a client, num_clients of them
        try:
            config.check_data_clients(f"num_clients = {config.partition.num_clients}, one SuperNode each")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def check_simulation_resumable(config: BaseConfig, results: ResultsFolder) -> None:
    """Refuse to continue a Flower simulation whose clients kept their states in memory: they lived
    in the virtual SuperNodes, which ended with that process, so the run would go on with other
    numbers (with ``state_store = "disk"`` it resumes)."""
    if config.run.state_store == "memory" and any(results.root.glob("checkpoints/*.pt")):
        raise ConfigError(
            f"{results.root} was run on Flower's Simulation Engine with state_store = \"memory\": its clients' "
            "states lived in the virtual SuperNodes, which ended with that process, so it cannot continue with "
            'the same numbers; run it again into a new folder (with state_store = "disk" a Flower simulation '
            "resumes)"
        )


class FlowerBackend:
    """Backend: each seed's clients are discovered on the grid; rounds run through Flower's
    ``Strategy.start`` with the pflkit strategy. Client states stay on the nodes."""

    keeps_client_states = False

    def __init__(
        self,
        config: BaseConfig,
        config_text: str,
        grid: Grid,
        timeout: float,
        wait_seconds: float,
        client_state_dir: Path | None = None,
    ) -> None:
        """``client_state_dir``: a folder every client reaches (Flower's Simulation Engine), where
        clients keep their states instead of in their nodes' memory (``state_store = "disk"``)."""
        check_flower_config(config, simulation=client_state_dir is not None)
        self.client_state_dir = client_state_dir
        self.config = config
        self.config_text = config_text
        self.grid = grid
        self.timeout = timeout
        self.wait_seconds = wait_seconds
        self.device = resolve_device("cpu")
        self._nodes: dict[int, dict[int, int]] = {}
        self._init: dict[int, Any] = {}

    def setup_seed(self, seed: int) -> SeedStart:
        nodes, summaries, info = discover(
            self.grid, self.config, self.config_text, seed, self.wait_seconds, self.timeout
        )
        model, init = initial_params(
            self.config, (info["input_shape"], info["num_classes"], info["vocab_size"]), seed, self.device
        )
        self._nodes[seed], self._init[seed] = nodes, init
        record = {
            "dataset": self.config.dataset,
            "num_clients": len(summaries),
            "num_classes": info["num_classes"],
            "source": "the SuperNodes' training label counts",
            "train_class_counts": [s.label_counts.tolist() for s in summaries],
        }
        return SeedStart(
            init,
            model.units(),
            summaries,
            partition_seed(self.config, seed),
            record,
            f"{self.config.dataset}: training labels per client on Flower (seed {seed})",
            self._global_evaluation(model, summaries, info["num_classes"], partition_seed(self.config, seed)),
        )

    def _global_evaluation(
        self, model: Any, summaries: list[Any], num_classes: int, pseed: int
    ) -> GlobalEvaluation | None:
        """The official protocol's global test set, read on the ServerApp's host (its data_dir), in
        the clients' domains where ``feature_shift.global_test = "domains"``."""
        if not self.config.partition.official:
            return None
        dataset = load_dataset(
            self.config.dataset, self.config.data_dir, official_test=True, emnist_split=self.config.data.emnist_split
        )
        _, test = official_split(dataset)
        counts = np.stack([s.label_counts for s in summaries]).astype(np.float64)
        priors = counts / np.maximum(counts.sum(1, keepdims=True), 1.0)
        x, y = dataset.x[torch.as_tensor(test)].to(self.device), dataset.y[torch.as_tensor(test)].to(self.device)
        shift = self.config.feature_shift
        if shift.active and shift.global_test == "domains":
            value_range = (float(dataset.x.min()), float(dataset.x.max()))
            x = shift_test_set(x, shift, len(summaries), pseed, value_range)
        return GlobalEvaluation(model, x, y, num_classes, priors, self.config.train.eval_batch_size)

    def run(self, session: RunSession) -> None:
        driver, state = session.driver, session.state
        strategy = PflkitStrategy(
            session,
            self.config_text,
            self._nodes[driver.seed],
            self.client_state_dir,
            tolerate_failures=self.config.run.tolerate_failures,
            min_replies=self.config.run.min_replies,
        )
        strategy.start(
            self.grid,
            initial_arrays=ArrayRecord(torch_state_dict=self._init[driver.seed]),
            num_rounds=driver.rounds,
            timeout=self.timeout,
        )
        if not state.done:
            raise RuntimeError(f"{driver.algorithm.name} seed {driver.seed}: the final evaluation did not run")


def run_on_flower(
    config: BaseConfig,
    grid: Grid,
    out: str | Path,
    *,
    timeout: float | None = None,
    wait_seconds: float = 120.0,
    simulation: bool = False,
) -> dict[str, Any]:
    """The Flower counterpart of ``run_experiment`` (same records, summary and plots).
    ``timeout``: seconds to wait for a round's replies (default: ``[run] reply_timeout``).

    The server state, history and round are checkpointed in ``out`` after every
    ``checkpoint_every`` aggregations; started again with the same config and ``out`` (a
    restarted ServerApp), the run continues where it stopped. ``simulation``: the clients are
    virtual SuperNodes that reach ``out`` (with ``state_store = "disk"`` they keep their states in
    its ``states/flower`` folder).
    """
    check_flower_config(config, simulation)
    results = ResultsFolder(out)
    state_dir = results.root / "states" / "flower" if simulation and config.run.state_store == "disk" else None
    config_dict = to_dict(config)
    kind = "flower-simulation" if simulation else "flower"
    with results.locked():
        if results.start_or_resume(config_dict, lambda saved: resolved(saved, results.where("config.toml")), kind):
            if simulation:
                check_simulation_resumable(config, results)
            log.info("continuing the unfinished run in %s from its checkpoints", results.root)
            results.rewrite_metrics(results.saved_histories(config.algorithms, config.seeds))
            results.set_status("running")
        backend = FlowerBackend(
            config,
            tomli_w.dumps(config_dict),
            ResilientGrid(grid, wait_seconds),
            config.run.reply_timeout if timeout is None else timeout,
            wait_seconds,
            state_dir,
        )
        summary = run_all(config, results, backend, RunSummarizer(), progress=False)
    if not simulation:  # pflkit run --on flower-simulation prints the table itself
        log.info("\n%s\nresults: %s", format_table(summary), results.root)
    return summary

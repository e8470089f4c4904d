"""A Flower strategy that runs any pflkit algorithm (``flwr.serverapp.strategy.Strategy``).

Flower's ``Strategy.start`` drives the rounds; this strategy keeps pflkit's server state and
fills Flower's hooks with pflkit's functions: ``configure_train`` samples clients with the
simulator's stream and sends each its own ``downlink`` payload; ``aggregate_train`` applies the
algorithm's ``aggregate`` and records the personalised evaluation that came back with the train
replies; after the last round ``configure_evaluate`` starts the final evaluation-only pass.
Rounds, records and metrics mean exactly what they mean in the simulator (docs/metrics.md).
The ``arrays`` argument Flower passes around is not used: the server state lives here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Sequence

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..algorithms import Algorithm
from ..config import BaseConfig
from ..engines.base import ClientResult
from ..run.rounds import Callback, RunState, make_record, sample_clients, should_evaluate, training_metrics, uploads_of
from . import serde

log = logging.getLogger(__name__)


class PflkitStrategy(Strategy):
    def __init__(self, config: BaseConfig, config_text: str, algorithm: Algorithm, state: RunState,
                 nodes: dict[int, int], callbacks: Sequence[Callback] = ()) -> None:
        self.config = config
        self.config_text = config_text
        self.algorithm = algorithm
        self.state = state
        self.nodes = nodes  # pflkit client id -> Flower node id
        self.callbacks = list(callbacks)
        self._started = 0.0
        self._evaluate = False

    def summary(self) -> None:
        log.info("pflkit strategy: %s, seed %d, %d clients, %d rounds", self.algorithm.name, self.state.seed,
                 self.config.num_clients, self.config.rounds)

    def _message(self, client_id: int, round: int, evaluate: bool, message_type: str) -> Message:
        content = RecordDict({"pflkit": ConfigRecord({
            "config": self.config_text, "algorithm": self.algorithm.name, "seed": self.state.seed,
            "round": round, "evaluate": evaluate})})
        serde.put(content, "payload", self.algorithm.downlink(self.state.server, client_id, round))
        return Message(content, dst_node_id=self.nodes[client_id], message_type=message_type, group_id=str(round))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if server_round <= self.state.rounds_done:  # done before a restart (restored from the checkpoint)
            return []
        self._started = time.perf_counter()
        selected = sample_clients(self.state.seed, server_round, self.config.num_clients, self.config.join_ratio)
        self._evaluate = should_evaluate(server_round - 1, self.config.rounds, self.config.eval_every)
        self._expected = len(selected)
        return [self._message(cid, server_round, self._evaluate, MessageType.TRAIN) for cid in selected]

    def _results(self, replies: Iterable[Message], round: int, train: bool) -> list[ClientResult]:
        replies = list(replies)
        errors = [r.error.reason for r in replies if r.has_error()]
        if errors:
            raise RuntimeError(f"round {round}: {len(errors)} client(s) failed: {errors[0]}")
        if len(replies) != self._expected:
            raise RuntimeError(f"round {round}: {len(replies)} of {self._expected} sampled clients replied "
                               "(a node is down or the timeout is too short)")
        results = []
        for reply in replies:
            metrics = dict(reply.content["metrics"])
            client_id = int(metrics.pop("client-id"))
            evaluation = None
            if "eval.correct" in metrics:
                evaluation = {"correct": int(metrics.pop("eval.correct")), "loss_sum": metrics.pop("eval.loss_sum"),
                              "num_samples": int(metrics.pop("eval.num_samples"))}
            upload = serde.get(reply.content, "upload") if train else None
            metrics.pop("num-examples", None)
            results.append(ClientResult(client_id, None, upload, evaluation, metrics))
        return sorted(results, key=lambda r: r.client_id)  # the simulator's aggregation order

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if server_round <= self.state.rounds_done:
            return None, None
        results = self._results(replies, server_round, train=True)
        state = self.state
        state.server = self.algorithm.aggregate(state.server, uploads_of(results), server_round)
        record = make_record(state, server_round - 1, results if self._evaluate else None)
        state.pending = training_metrics(server_round, results, time.perf_counter() - self._started)
        state.rounds_done = server_round
        self._emit(record)
        arrays = ArrayRecord(torch_state_dict=self.algorithm.global_params(state.server))
        return arrays, MetricRecord({"train_loss": state.pending["train_loss"]})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if server_round != self.config.rounds:
            return []
        final = server_round + 1
        selected = sample_clients(self.state.seed, final, self.config.num_clients, self.config.join_ratio)
        self._expected = len(selected)
        return [self._message(cid, final, True, MessageType.EVALUATE) for cid in selected]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        if server_round != self.config.rounds:
            return None
        record = make_record(self.state, server_round, self._results(replies, server_round + 1, train=False))
        self.state.pending = None
        self.state.done = True
        self._emit(record)
        return MetricRecord({"accuracy": record["accuracy"]})

    def _emit(self, record: dict[str, Any]) -> None:
        self.state.history.append(record)
        if "accuracy" in record:
            log.info("%s seed %d round %d: accuracy %.4f", self.algorithm.name, self.state.seed, record["round"],
                     record["accuracy"])
        for callback in self.callbacks:
            callback.on_record(self.state, record)

"""A Flower strategy that runs any pflkit algorithm (``flwr.serverapp.strategy.Strategy``).

Flower's ``Strategy.start`` drives the rounds; this strategy fills its hooks with the round
driver's plan and finish (``pflkit.federation.driver``): ``configure_train`` sends each planned
client its own payload, ``aggregate_train`` hands the replies to the driver, which aggregates
and records them; after the last round, or once a stop rule (the plateau rule) ends training,
``configure_evaluate`` sends the final evaluation-only plan and Flower's remaining rounds send
nothing. Rounds done before a restart (restored from the checkpoint) are skipped. The ``arrays``
argument Flower passes around is not used: the server state lives in the run state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..engines.base import ClientJob, ClientResult
from ..federation.driver import RoundDriver, RoundPlan, RunState
from ..federation.session import RunSession
from ..federation.stopping import check_stop
from .logs import client_error
from .serde import get as get_values
from .serde import put as put_values

log = logging.getLogger(__name__)


class PflkitStrategy(Strategy):
    def __init__(
        self,
        session: RunSession,
        config_text: str,
        nodes: dict[int, int],
        client_state_dir: Path | None = None,
        *,
        tolerate_failures: bool = False,
        min_replies: int = 1,
    ) -> None:
        """``client_state_dir``: where clients keep their states on disk rather than in their nodes'
        memory (a folder they all reach: Flower's Simulation Engine); None: in ``context.state``.
        ``tolerate_failures``: a client that fails or does not reply counts as dropped for the round
        (the run stops only when fewer than ``min_replies`` of the round's clients reply)."""
        self.tolerate_failures = tolerate_failures
        self.min_replies = min_replies
        self.session = session
        self.config_text = config_text
        self.nodes = nodes  # pflkit client id -> Flower node id
        self.client_state_dir = client_state_dir
        self._plan: RoundPlan | None = None

    @property
    def driver(self) -> RoundDriver:
        return self.session.driver

    @property
    def state(self) -> RunState:
        return self.session.state

    def summary(self) -> None:
        log.info(
            "pflkit strategy: %s, seed %d, %d clients, %d rounds",
            self.driver.algorithm.name,
            self.driver.seed,
            self.driver.num_clients,
            self.driver.rounds,
        )

    def _messages(self, plan: RoundPlan, message_type: str) -> list[Message]:
        self._plan = plan
        return [self._message(job, plan.round, message_type) for job in [*plan.jobs, *plan.newcomer_jobs]]

    def _message(self, job: ClientJob, round: int, message_type: str) -> Message:
        content = RecordDict(
            {
                "pflkit": ConfigRecord(
                    {
                        "config": self.config_text,
                        "algorithm": self.driver.algorithm.name,
                        "seed": self.driver.seed,
                        "round": round,
                        "evaluate": job.evaluate,
                        **({"newcomer": job.finetune} if job.finetune is not None else {}),
                        **({"newcomer-steps": job.finetune_steps} if job.finetune_steps is not None else {}),
                        **({"newcomer-lr": job.finetune_lr} if job.finetune_lr is not None else {}),
                        "work": job.work,  # < 1: a straggler
                        **({"lost-rounds": lost} if (lost := self._lost_rounds(job.client_id)) else {}),
                        **({"state-dir": str(self.client_state_dir)} if self.client_state_dir is not None else {}),
                    }
                )
            }
        )
        put_values(content, "payload", job.payload)
        return Message(content, dst_node_id=self.nodes[job.client_id], message_type=message_type, group_id=str(round))

    def _lost_rounds(self, client_id: int) -> list[int]:
        """The training rounds whose reply from ``client_id`` did not count (recorded as
        ``lost_replies``): its node drops the states it saved after them, so that it goes on as a
        dropped client of the simulator would, from its state before the lost round."""
        records = [*self.state.history, *([self.state.pending] if self.state.pending else [])]
        return sorted({int(r["train_round"]) for r in records if client_id in r.get("lost_replies", ())})

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        check_stop()
        if server_round <= self.state.rounds_done:  # done before a restart (restored from the checkpoint)
            return []
        if self.state.done or self.session.training_over():  # a stop rule ended training: Flower's rounds idle
            return []
        return self._messages(self.driver.plan(self.state, server_round), MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._plan is None or not self._plan.train or self._plan.round != server_round:
            return None, None  # nothing was sent this round
        self._finish(replies, train=True)
        arrays = ArrayRecord(torch_state_dict=self.driver.algorithm.global_params(self.state.server))
        pending = self.state.pending
        assert pending is not None  # (the training stats of the round just finished)
        return arrays, MetricRecord({"train_loss": pending["train_loss"]})

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if server_round < self.state.rounds_done or not self.session.training_over():
            return []
        plan = self.session.next_plan()  # the final evaluation (after the last round, or a stop rule's)
        if plan is None or plan.train:
            return []
        return self._messages(plan, MessageType.EVALUATE)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        if self._plan is None or self._plan.train or self.state.done:
            return None
        record = self._finish(replies, train=False)
        return MetricRecord({"accuracy": record["accuracy"]})

    def _finish(self, replies: Iterable[Message], train: bool) -> dict[str, Any]:
        plan = self._plan
        assert plan is not None
        record = self.session.finish(plan, self._results(replies, plan, train))
        if "accuracy" in record:
            log.info(
                "%s seed %d round %d: accuracy %.4f",
                self.state.algorithm,
                self.state.seed,
                record["round"],
                record["accuracy"],
            )
        return record

    def _results(self, replies: Iterable[Message], plan: RoundPlan, train: bool) -> list[ClientResult]:
        replies = list(replies)
        failed = [r for r in replies if r.has_error()]
        if self.tolerate_failures:
            replies = self._tolerated(replies, plan)
        elif failed:
            clients = {node: cid for cid, node in self.nodes.items()}
            first = clients.get(failed[0].metadata.src_node_id, "?")
            others = f" ({len(failed) - 1} more client(s) failed)" if len(failed) > 1 else ""
            raise RuntimeError(
                f"{self.state.algorithm} seed {self.state.seed} round {plan.round}: client {first} failed: "
                f"{client_error(failed[0].error.reason)}{others}"
            )
        expected = len(plan.jobs) + len(plan.newcomer_jobs)
        if len(replies) != expected and not self.tolerate_failures:
            raise RuntimeError(
                f"round {plan.round}: {len(replies)} of {expected} sampled clients replied "
                "(a node is down or the timeout is too short; [run] tolerate_failures = true counts them "
                "as dropped)"
            )
        results = []
        for reply in replies:
            metrics: dict[str, Any] = dict(reply.content["metrics"])  # the MetricRecord the client app wrote
            client_id = int(metrics.pop("client-id"))
            evaluation = None
            if "eval.correct" in metrics:
                evaluation = {
                    "correct": int(metrics.pop("eval.correct")),
                    "loss_sum": metrics.pop("eval.loss_sum"),
                    "num_samples": int(metrics.pop("eval.num_samples")),
                }
            upload = get_values(reply.content, "upload") if train and client_id not in self.driver.unseen else None
            metrics.pop("num-examples", None)
            results.append(ClientResult(client_id, None, upload, evaluation, metrics))
        return results

    def _tolerated(self, replies: list[Message], plan: RoundPlan) -> list[Message]:
        """The replies without errors; the clients of the plan without one count as dropped."""
        ok = [r for r in replies if not r.has_error()]
        clients = {node: cid for cid, node in self.nodes.items()}
        replied = {clients.get(r.metadata.src_node_id) for r in ok}
        missing = [job.client_id for job in plan.jobs if job.client_id not in replied]
        trained = len(plan.jobs) - len(missing)  # newcomers' replies are scores, not uploads: not counted
        if trained < min(self.min_replies, len(plan.jobs)):
            raise RuntimeError(
                f"{self.state.algorithm} seed {self.state.seed} round {plan.round}: {trained} of "
                f"{len(plan.jobs)} clients replied, fewer than min_replies = {self.min_replies}"
            )
        if missing:
            log.warning("round %d: client(s) %s failed or did not reply; counted as dropped", plan.round, missing)
            plan.dropped = sorted(set(plan.dropped) | set(missing))
            if plan.train:
                plan.lost = missing
        scored = [job.client_id for job in plan.newcomer_jobs if job.client_id not in replied]
        if scored:
            log.warning("round %d: unseen client(s) %s failed or did not reply; not scored", plan.round, scored)
        return ok

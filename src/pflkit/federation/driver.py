"""The round driver: the one place that says what a federated round is.

Every executor (the simulator's engines, the Flower strategy) asks the driver for the next
round's plan (which clients, with which payloads and states), executes it however it likes,
and hands the results back; the driver aggregates, records and advances the run's state:

    plan = driver.next_plan(state)        # training round t, or the final evaluation, or None
    results = <run plan.jobs>             # simulator engine, or Flower messages
    record = driver.finish(state, plan, results)

Evaluation convention (FedALA/PFLlib; docs/explanations/metrics.md): the model evaluated at
"round r" is each evaluated client's ``eval_params`` right after ``local_init`` with the server
state produced by r aggregations, i.e. at the start of training round r + 1 (round 0 = the initial
model). After the last round a final evaluation-only pass scores round T. With join_ratio < 1 the
evaluated clients of round r are those sampled for round r + 1 (FedALA paper, Appendix F: results
"collected from the joining clients").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..algorithms.base import ROUND_INFO, Aggregator, Algorithm, ClientSummary, SentUpload, State
from ..engines.base import CLIENT_TIMINGS, ClientJob, ClientResult
from ..functional import Params, message_size, numpy_generator
from .evaluation import GlobalEvaluation
from .newcomers import Newcomers, newcomer_metrics, participants
from .record_form import recorded
from .reliability import Reliability, round_fields
from .state_store import ClientStore, MemoryStateStore


@dataclass
class RunState:
    """Everything needed to continue a run: checkpointed after rounds, restored on resume.
    ``clients`` is empty where client states live elsewhere (on Flower nodes)."""

    algorithm: str
    seed: int
    rounds_done: int
    server: State
    clients: ClientStore  # in memory, or on disk (state_store = "disk")
    history: list[dict[str, Any]] = field(default_factory=list)
    pending: dict[str, Any] | None = None  # training stats of the last round, awaiting its evaluation
    done: bool = False
    client_store: dict[str, Any] | None = None  # a checkpoint's record of clients kept in files
    config_sha256: str | None = None  # the digest of the results folder's config the run belongs to


class Callback(Protocol):
    """Watches every record of a run (checkpoints, metrics.jsonl, progress, trackers)."""

    def on_record(self, state: RunState, record: dict[str, Any]) -> None: ...


@runtime_checkable
class StopRule(Protocol):
    """A callback that may end a run's training before its ``rounds``: asked before each training
    round; a reason (``"plateau"``) ends training, and the final evaluation's record says it."""

    def on_record(self, state: RunState, record: dict[str, Any]) -> None: ...

    def stop_reason(self, state: RunState) -> str | None: ...


@dataclass
class RoundPlan:
    """One round to execute: its number, the client jobs and whether it trains (False: the
    final evaluation-only pass)."""

    round: int
    jobs: list[ClientJob]
    evaluate: bool
    train: bool
    started: float = field(default_factory=time.perf_counter)
    global_metrics: dict[str, Any] = field(default_factory=dict)  # the global model before this round
    # clients evaluated without training (``evaluate_all``): their states are discarded
    eval_jobs: list[ClientJob] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)  # selected clients that fail to return their upload
    lost: list[int] = field(default_factory=list)  # of those, the ones that trained (Flower: the reply was lost)
    stopped: str | None = None  # the final pass of a run whose training a stop rule ended: why
    newcomer_jobs: list[ClientJob] = field(default_factory=list)  # the unseen clients, at evaluations


def sample_clients(seed: int, round: int, num_clients: int, join_ratio: float) -> list[int]:
    """floor(join_ratio * N) clients (at least one), uniform without replacement."""
    k = max(1, int(join_ratio * num_clients))
    if k >= num_clients:
        return list(range(num_clients))
    rng = numpy_generator(seed, "select", round)
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))


def should_evaluate(r: int, rounds: int, eval_every: int) -> bool:
    return r % eval_every == 0 or r == rounds


@dataclass(frozen=True)
class Plateau:
    """The convergence rule of a run that stops before its ``rounds`` (then only a cap): the best
    ``metric`` has not improved by more than ``points`` percentage points over the last
    ``evaluations`` evaluations, judged from the evaluation of round ``not_before`` on. A
    ``StopRule``: a session with it among its callbacks ends training once it is reached."""

    evaluations: int
    points: float = 0.1
    metric: str = "accuracy"
    not_before: int = 0  # no stop before an evaluation of this round (a method's schedule still runs)

    def reached(self, history: Sequence[dict[str, Any]]) -> bool:
        scored = [r for r in history if isinstance(r.get(self.metric), (int, float)) and not np.isnan(r[self.metric])]
        if not scored or scored[-1].get("round", 0) < self.not_before:
            return False
        values = [float(r[self.metric]) for r in scored]
        if len(values) <= self.evaluations:
            return False
        return max(values) - max(values[: -self.evaluations]) <= self.points / 100

    def on_record(self, state: RunState, record: dict[str, Any]) -> None:
        pass

    def stop_reason(self, state: RunState) -> str | None:
        return "plateau" if self.reached(state.history) else None


def evaluation_metrics(results: Sequence[ClientResult], local_test: bool = False) -> dict[str, Any]:
    """Pooled (sample-weighted) and per-client accuracy of the evaluated clients; with
    ``local_test`` (the official protocol's local test sets) also ``local_accuracy``, the mean over
    clients of their accuracy (SosicFL's local accuracy)."""
    evals = [(r.client_id, r.evaluation) for r in results if r.evaluation is not None]
    correct = sum(e["correct"] for _, e in evals)
    total = sum(e["num_samples"] for _, e in evals)
    per_client = {cid: e["correct"] / e["num_samples"] for cid, e in evals if e["num_samples"] > 0}
    accs = np.array(list(per_client.values()), dtype=float)
    local = {"local_accuracy": float(accs.mean()) if len(accs) else float("nan")} if local_test else {}
    return {
        **local,
        "accuracy": correct / total if total else float("nan"),
        "mean_client_accuracy": float(accs.mean()) if len(accs) else float("nan"),
        "std_client_accuracy": float(accs.std()) if len(accs) else float("nan"),
        "test_loss": sum(e["loss_sum"] for _, e in evals) / total if total else float("nan"),
        "evaluated_clients": len(evals),
        "client_accuracy": {str(k): v for k, v in per_client.items()},
    }


_REDUCE: dict[str, Callable[[np.ndarray], Any]] = {"mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min}


def training_metrics(
    round: int, results: Sequence[ClientResult], seconds: float, reductions: Mapping[str, str] = {}
) -> dict[str, Any]:
    """Round wall time, sample-weighted train loss and per-client diagnostics of one round, each
    reduced over the clients for which it is not NaN as ``reductions`` says (the engines' wall
    times ``CLIENT_TIMINGS`` summed, a method's own ``metric_reductions``; default the mean); what
    else a method reports of its round comes from its ``Algorithm.round_metrics``."""
    reductions = {**CLIENT_TIMINGS, **reductions}
    weights = np.array([r.upload["num_samples"] for r in results if r.upload is not None], dtype=float)
    losses = np.array([r.metrics.get("train_loss", np.nan) for r in results], dtype=float)
    out: dict[str, Any] = {
        "train_round": round,
        "seconds": seconds,
        "train_loss": float((weights * losses).sum() / weights.sum()) if weights.sum() else float("nan"),
    }
    keys = sorted({k for r in results for k, v in r.metrics.items() if k != "train_loss" and np.isscalar(v)})
    for key in keys:
        values = np.array([r.metrics[key] for r in results if key in r.metrics], dtype=float)
        values = values[~np.isnan(values)]
        if not len(values):
            continue
        out[key] = float(_REDUCE[reductions.get(key, "mean")](values))
    return out


def communication(jobs: Sequence[ClientJob], upload_sizes: Sequence[tuple[int, int]]) -> dict[str, float]:
    """Values and bytes of the round's payloads and uploads (``message_size`` of each upload, the
    sample count it carries left out), counted from the real messages: per participating client
    (mean) and for the round (sum)."""
    down = [message_size(j.payload) for j in jobs]
    out: dict[str, float] = {}
    for name, sizes in (("down", down), ("up", upload_sizes)):
        if sizes:
            out[f"{name}_floats_per_client"] = float(np.mean([s[0] for s in sizes]))
            out[f"{name}_bytes"] = float(sum(s[1] for s in sizes))
    return out


def update_variance(updates: Sequence[torch.Tensor | None]) -> float | None:
    """Total variance of the participants' last-layer updates (``Algorithm.head_update``),
    sum_k ||dw_k - mean dw||^2 (SosicFL Eq. 10); None where uploads carry no head."""
    if not updates or any(u is None for u in updates):
        return None
    stacked = torch.stack([u for u in updates if u is not None])  # (every one, checked above)
    return float(((stacked - stacked.mean(0)) ** 2).sum())


class OpenRound:
    """A round whose client results arrive one at a time (``add``) until ``close`` records it.

    A trained client's state goes to the store as it arrives. Where the method's server rule is a
    weighted sum (``Algorithm.aggregator``) and the clients' training-set sizes are known
    (``sizes``), its upload is folded in as soon as the uploads before it in ``upload_order`` are
    (engines deliver them in that order, so none waits), and only the small part of each result is
    kept (metrics, evaluation, message sizes): the round's memory does not grow with its clients.
    Otherwise the uploads are kept for ``Algorithm.aggregate``; both give the same bits."""

    def __init__(
        self, driver: RoundDriver, state: RunState, plan: RoundPlan, sizes: Mapping[int, int] | None = None
    ) -> None:
        self.driver, self.state, self.plan = driver, state, plan
        self.participants = {j.client_id for j in plan.jobs}
        self.results: list[ClientResult] = []  # without states and parameters
        self.newcomers: list[ClientResult] = []  # the unseen clients' evaluations
        self.uploads: dict[int, SentUpload] = {}  # kept for ``aggregate``, or waiting for their turn
        self.heads: dict[int, torch.Tensor | None] = {}
        self.upload_sizes: list[tuple[int, int]] = []
        self.arrived = 0  # uploads received
        self.aggregator: Aggregator | None = None
        if plan.train and sizes is not None and self.participants:
            self.expected = {c: sizes[c] for c in self.participants}
            self.aggregator = driver.algorithm.aggregator(state.server, plan.round, sum(self.expected.values()))
            self.order = sorted(self.participants, key=lambda c: (-self.expected[c], c))
            self.folded = 0

    def add(self, result: ClientResult) -> None:
        cid = result.client_id
        if cid in self.driver.unseen:  # a newcomer's evaluation: nothing of it is kept but its scores
            self.newcomers.append(replace(result, state=None, upload=None))
            return
        if not (self.plan.train and cid in self.participants):  # evaluated only: its state is discarded
            self.results.append(replace(result, state=None, upload=None))
            return
        if result.state is not None:
            self.state.clients[cid] = result.state
        upload = result.upload
        if upload is not None:
            # the ignore: the engine split the upload per client, so its num_samples is a number (as SentUpload's)
            sent: SentUpload = {**upload, "client_id": cid}  # type: ignore[typeddict-item]
            head = self.driver.algorithm.head_update(self.state.server, sent)
            self.heads[cid] = None if head is None else head.detach().float().cpu()
            self.upload_sizes.append(message_size({k: v for k, v in upload.items() if k != "num_samples"}))
            self.arrived += 1
            self._take(sent)
            upload = {"num_samples": upload["num_samples"]}  # type: ignore[assignment]  # kept: its size alone
        self.results.append(replace(result, state=None, upload=upload))

    def _take(self, upload: SentUpload) -> None:
        cid = upload["client_id"]
        self.uploads[cid] = upload
        if self.aggregator is None:
            return
        if float(upload["num_samples"]) != float(self.expected[cid]):
            raise ValueError(
                f"round {self.plan.round}: client {cid} uploaded num_samples = {upload['num_samples']}, "
                f"but its training set has {self.expected[cid]} samples; a weighted-sum server rule "
                "needs the weights announced before the uploads (override Algorithm.aggregator)"
            )
        while self.folded < len(self.order) and self.order[self.folded] in self.uploads:
            self.aggregator.add(self.uploads.pop(self.order[self.folded]))
            self.folded += 1

    def close(self) -> dict[str, Any]:
        """Aggregate the uploads, advance the run's state and return the record of the evaluated
        round (``plan.round - 1``, or T for the final pass)."""
        driver, state, plan = self.driver, self.state, self.plan
        results = sorted(self.results, key=lambda r: r.client_id)
        evaluated = results if plan.evaluate else None
        results = [r for r in results if r.client_id in self.participants]  # eval-only clients change nothing
        if not plan.train:
            record = driver._record(state, state.rounds_done, evaluated, plan, self.newcomers)
            if plan.stopped is not None:
                record["stopped"] = plan.stopped
            # the final evaluation pass is waited for too (and may run ALA's start phase first)
            record["final_pass_seconds"] = time.perf_counter() - plan.started
            init = [r.metrics["init_seconds"] for r in results if "init_seconds" in r.metrics]
            if init:
                record["final_pass_init_seconds"] = float(np.sum(init))
            state.pending = None
            state.done = True
            record = recorded(record)
            state.history.append(record)
            return record
        variance = update_variance([self.heads[c] for c in sorted(self.heads)])
        if not self.arrived:  # every selected client dropped: the server state stays as it was
            pass
        elif self.aggregator is not None:
            if self.folded < len(self.order):
                missing = [c for c in self.order[self.folded :] if c not in self.uploads]
                raise RuntimeError(f"round {plan.round}: no upload from clients {missing[:10]}")
            state.server = self.aggregator.result()
        else:
            state.server = driver.algorithm.aggregate(
                state.server, [self.uploads[c] for c in sorted(self.uploads)], plan.round
            )
        info = state.server.pop(ROUND_INFO, None)  # what the server rule reports (FedACD's weights)
        record = driver._record(state, plan.round - 1, evaluated, plan, self.newcomers)
        state.pending = training_metrics(
            plan.round, results, time.perf_counter() - plan.started, driver.algorithm.metric_reductions
        )
        state.pending.update(driver.algorithm.round_metrics({r.client_id: r.metrics for r in results}))
        if info:
            state.pending.update(info)
        state.pending.update(communication(plan.jobs, self.upload_sizes))
        if variance is not None:
            state.pending["update_variance"] = variance
        if driver.records_drops or plan.dropped:
            state.pending.update(round_fields(plan.dropped, plan.jobs, self.arrived, plan.lost))
        risks = [
            driver.global_evaluation.local_risk(r.metrics["class_correct"])
            for r in results
            if driver.global_evaluation is not None and "class_correct" in r.metrics
        ]
        if risks:  # [metrics] adaptability: the trained local models' risk over the clients' distributions
            state.pending["local_risk"] = float(np.mean(risks))
        state.rounds_done = plan.round
        record = recorded(record)
        state.history.append(record)
        return record


class RoundDriver:
    """Plans and finishes the rounds of one (algorithm, seed) run."""

    def __init__(
        self,
        algorithm: Algorithm,
        *,
        num_clients: int,
        seed: int,
        rounds: int,
        join_ratio: float,
        eval_every: int,
        global_evaluation: GlobalEvaluation | None = None,
        local_test: bool = False,
        evaluate_all: bool = False,
        newcomers: Newcomers | None = None,
        reliability: Reliability | None = None,
        records_drops: bool = False,
    ) -> None:
        """``global_evaluation`` scores the global model of every evaluated round on the global
        test set (algorithms with a global model); ``local_test``: clients are scored on local
        test sets (the official protocol) and records carry ``local_accuracy``; ``evaluate_all``:
        every participant is scored at each evaluation, sampled or not (SosicFL's protocol);
        ``newcomers``: clients that never train, scored as newcomers at each evaluation
        (``pflkit.federation.newcomers``); ``reliability``: which selected clients drop out or
        straggle (None: none); ``records_drops``: every training round's record says how many
        clients dropped even without a ``reliability`` rule (Flower's ``tolerate_failures``)."""
        self.algorithm = algorithm
        self.num_clients = num_clients
        self.seed = seed
        self.rounds = rounds
        self.join_ratio = join_ratio
        self.eval_every = eval_every
        self.reliability = reliability
        self.records_drops = records_drops or reliability is not None
        self.global_evaluation = global_evaluation if algorithm.has_global_model else None
        self.local_test = local_test
        self.evaluate_all = evaluate_all
        self.newcomers = newcomers
        self.unseen = frozenset(newcomers.ids if newcomers is not None else ())
        self.participants = participants(num_clients, sorted(self.unseen))
        if not self.participants:
            raise ValueError(f"all {num_clients} clients are unseen: no client is left to train")

    def start(
        self,
        init_params: Params,
        summaries: list[ClientSummary],
        *,
        client_states: bool = True,
        store: ClientStore | None = None,
    ) -> RunState:
        """Server (and, with ``client_states``, client) states from the common initial model,
        then the algorithm's ``prepare`` from the clients' summaries. A ``store`` (the disk store)
        makes each client's state on first use instead."""
        alg = self.algorithm
        summaries = [s for s in summaries if s.client_id not in self.unseen]  # the participants only
        server = alg.prepare(alg.init_server(init_params), summaries, self.seed)
        clients: ClientStore
        if store is not None:
            clients = store
        elif client_states:  # the participants' (summaries holds them only)
            clients = MemoryStateStore({s.client_id: alg.init_client(init_params, s.client_id) for s in summaries})
        else:
            clients = MemoryStateStore()
        return RunState(algorithm=alg.name, seed=self.seed, rounds_done=0, server=server, clients=clients)

    def next_plan(self, state: RunState, stopped: str | None = None) -> RoundPlan | None:
        """The next training round, the final evaluation after the last one (or once a stop rule
        gave the reason ``stopped``), or None when done."""
        if state.done:
            return None
        if state.rounds_done < self.rounds and stopped is None:
            return self.plan(state, state.rounds_done + 1)
        return self.plan_final(state, stopped if state.rounds_done < self.rounds else None)

    def plan(self, state: RunState, t: int) -> RoundPlan:
        """Training round ``t``: sampled clients with their payloads and states; it also
        evaluates round ``t - 1`` when that round is due."""
        selected = self.sample(t)
        evaluate = should_evaluate(t - 1, self.rounds, self.eval_every)
        rule = self.reliability
        dropped = rule.dropped(self.seed, t, selected) if rule is not None else []
        taking = [c for c in selected if c not in dropped]  # a dropped client's job never runs
        plan = RoundPlan(t, self._jobs(state, taking, t, evaluate, True), evaluate, True, dropped=dropped)
        if rule is not None:
            for job in plan.jobs:
                job.work = rule.work(self.seed, t, job.client_id)
        if evaluate and self.evaluate_all:  # the dropped clients are scored too: their state did not go away
            others = sorted(set(self.participants) - set(taking))
            plan.eval_jobs = self._jobs(state, others, t, True, False)
        return self._scored(state, plan)

    def plan_final(self, state: RunState, stopped: str | None = None) -> RoundPlan:
        """The evaluation of the last trained round: local initialisation and evaluation, no
        training (``stopped``: why training ended before ``rounds``)."""
        final = state.rounds_done + 1
        selected = list(self.participants) if self.evaluate_all else self.sample(final)
        plan = RoundPlan(final, self._jobs(state, selected, final, True, False), True, False, stopped=stopped)
        return self._scored(state, plan)

    def sample(self, t: int) -> list[int]:
        """The participants sampled for round ``t`` (the unseen clients are never drawn)."""
        chosen = sample_clients(self.seed, t, len(self.participants), self.join_ratio)
        return [self.participants[i] for i in chosen]

    def _scored(self, state: RunState, plan: RoundPlan) -> RoundPlan:
        """The plan with the global model of the evaluated round scored on the global test set, and
        the jobs of the unseen clients scored as newcomers."""
        if plan.evaluate and self.global_evaluation is not None:
            plan.global_metrics = self.global_evaluation(self.algorithm.global_params(state.server))
        if plan.evaluate and self.newcomers is not None:
            plan.newcomer_jobs = self.newcomers.jobs(self.algorithm, state.server, plan.round)
        return plan

    def _jobs(self, state: RunState, selected: list[int], t: int, evaluate: bool, train: bool) -> list[ClientJob]:
        """The clients' jobs; states in memory go with them, states on disk are read when a job starts."""
        store, eager = state.clients, isinstance(state.clients, MemoryStateStore)
        return [
            ClientJob(
                i,
                self.algorithm.downlink(state.server, i, t),
                store.get(i) if eager else None,
                evaluate,
                train,
                load=None if eager else partial(store.__getitem__, i),
            )
            for i in selected
        ]

    def open_round(self, state: RunState, plan: RoundPlan, sizes: Mapping[int, int] | None = None) -> OpenRound:
        """The round of ``plan``, to which results are added as they arrive (see ``OpenRound``);
        ``sizes``: every client's training-set size, for folding uploads in as they come."""
        return OpenRound(self, state, plan, sizes)

    def finish(self, state: RunState, plan: RoundPlan, results: Sequence[ClientResult]) -> dict[str, Any]:
        """Take a round's results at once (Flower's replies): keep client states, aggregate the
        uploads, and return the record of the evaluated round."""
        round = self.open_round(state, plan)
        for result in results:
            round.add(result)
        return round.close()

    def _record(
        self,
        state: RunState,
        r: int,
        results: Sequence[ClientResult] | None,
        plan: RoundPlan,
        newcomers: Sequence[ClientResult] = (),
    ) -> dict[str, Any]:
        record: dict[str, Any] = {"algorithm": state.algorithm, "seed": state.seed, "round": r}
        if results is not None:
            record.update(evaluation_metrics(results, self.local_test))
            record.update(plan.global_metrics)
        if newcomers:
            record.update(newcomer_metrics(sorted(newcomers, key=lambda n: n.client_id)))
        if state.pending is not None:
            record.update(state.pending)
        return record

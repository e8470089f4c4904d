"""The one round loop: sample, downlink, local init / evaluate / train, aggregate, callbacks.

Evaluation convention (spec §5.7, FedALA/PFLlib): the model evaluated at "round r" is each
evaluated client's ``eval_params`` right after ``local_init`` with the server state produced by
r aggregations, i.e. at the start of training round r + 1 (round 0 = the initial model). After
the last round a final evaluation-only pass scores round T. With join_ratio < 1 the evaluated
clients of round r are those sampled for round r + 1 (spec: "only the joining clients").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from ..algorithms.base import ClientSummary, State
from ..engines.base import ClientJob, ClientResult, Engine, RoundSetup
from ..functional import Params, numpy_generator


@dataclass
class RunState:
    """Everything needed to continue a run: checkpointed after rounds, restored on resume."""

    algorithm: str
    seed: int
    rounds_done: int
    server: State
    clients: dict[int, State]
    history: list[dict[str, Any]] = field(default_factory=list)
    pending: dict[str, Any] | None = None  # training stats of the last round, awaiting its evaluation
    done: bool = False


class Callback(Protocol):
    def on_record(self, state: RunState, record: dict[str, Any]) -> None: ...


def sample_clients(seed: int, round: int, num_clients: int, join_ratio: float) -> list[int]:
    """floor(join_ratio * N) clients (at least one), uniform without replacement (spec §0.1)."""
    k = max(1, int(join_ratio * num_clients))
    if k >= num_clients:
        return list(range(num_clients))
    rng = numpy_generator(seed, "select", round)
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))


def should_evaluate(r: int, rounds: int, eval_every: int) -> bool:
    return r % eval_every == 0 or r == rounds


def start_run(setup: RoundSetup, init_params: Params) -> RunState:
    """Server and client states from the common initial model; then the ``prepare`` hook."""
    alg, data = setup.algorithm, setup.data
    summaries = [ClientSummary(i, data.clients[i].num_train, data.train_label_counts(i))
                 for i in range(data.num_clients)]
    server = alg.prepare(alg.init_server(init_params), summaries)
    clients = {i: alg.init_client(init_params, i) for i in range(data.num_clients)}
    return RunState(algorithm=alg.name, seed=setup.seed, rounds_done=0, server=server, clients=clients)


def evaluation_metrics(results: Sequence[ClientResult]) -> dict[str, Any]:
    """Pooled (sample-weighted) and per-client accuracy of the evaluated clients."""
    evals = [(r.client_id, r.evaluation) for r in results if r.evaluation is not None]
    correct = sum(e["correct"] for _, e in evals)
    total = sum(e["num_samples"] for _, e in evals)
    per_client = {cid: e["correct"] / e["num_samples"] for cid, e in evals if e["num_samples"] > 0}
    accs = np.array(list(per_client.values()), dtype=float)
    return {
        "accuracy": correct / total if total else float("nan"),
        "mean_client_accuracy": float(accs.mean()) if len(accs) else float("nan"),
        "std_client_accuracy": float(accs.std()) if len(accs) else float("nan"),
        "test_loss": sum(e["loss_sum"] for _, e in evals) / total if total else float("nan"),
        "evaluated_clients": len(evals),
        "client_accuracy": {str(k): v for k, v in per_client.items()},
    }


def training_metrics(round: int, results: Sequence[ClientResult], seconds: float) -> dict[str, Any]:
    """Round wall time, sample-weighted train loss and per-client diagnostics of one round."""
    weights = np.array([r.upload["num_samples"] for r in results if r.upload is not None], dtype=float)
    losses = np.array([r.metrics.get("train_loss", np.nan) for r in results], dtype=float)
    out: dict[str, Any] = {"train_round": round, "seconds": seconds,
                           "train_loss": float((weights * losses).sum() / weights.sum())}
    keys = sorted({k for r in results for k in r.metrics if k != "train_loss"})
    for key in keys:
        values = np.array([r.metrics[key] for r in results if key in r.metrics], dtype=float)
        out[key] = float(values.sum() if key.endswith("_seconds") else values.mean())
        if key == "ala_epochs":
            out["ala_epochs_max"] = float(values.max())
    return out


def uploads_of(results: Sequence[ClientResult]) -> list[dict[str, Any]]:
    """The round's uploads, each tagged with its sender's ``client_id`` (FedAMP, FedFomo, APPLE)."""
    return [{**r.upload, "client_id": r.client_id} for r in results if r.upload is not None]


def make_record(state: RunState, r: int, results: Sequence[ClientResult] | None) -> dict[str, Any]:
    record: dict[str, Any] = {"algorithm": state.algorithm, "seed": state.seed, "round": r}
    if results is not None:
        record.update(evaluation_metrics(results))
    if state.pending is not None:
        record.update(state.pending)
    return record


def run_round(setup: RoundSetup, engine: Engine, state: RunState, t: int, *, rounds: int, join_ratio: float,
              eval_every: int) -> dict[str, Any]:
    """Training round ``t``; returns the record of round ``t - 1`` (evaluated inside this round)."""
    alg = setup.algorithm
    start = time.perf_counter()
    selected = sample_clients(setup.seed, t, setup.data.num_clients, join_ratio)
    evaluate = should_evaluate(t - 1, rounds, eval_every)
    jobs = [ClientJob(i, alg.downlink(state.server, i, t), state.clients[i], evaluate) for i in selected]
    results = engine.run(setup, jobs, t)
    for res in results:
        state.clients[res.client_id] = res.state
    state.server = alg.aggregate(state.server, uploads_of(results), t)
    record = make_record(state, t - 1, results if evaluate else None)
    state.pending = training_metrics(t, results, time.perf_counter() - start)
    state.rounds_done = t
    state.history.append(record)
    return record


def final_evaluation(setup: RoundSetup, engine: Engine, state: RunState, *, rounds: int,
                     join_ratio: float) -> dict[str, Any]:
    """Evaluate round ``rounds`` (local init + evaluation, no training; states are not kept)."""
    final = rounds + 1
    selected = sample_clients(setup.seed, final, setup.data.num_clients, join_ratio)
    jobs = [ClientJob(i, setup.algorithm.downlink(state.server, i, final), state.clients[i], True, train=False)
            for i in selected]
    record = make_record(state, rounds, engine.run(setup, jobs, final))
    state.pending = None
    state.done = True
    state.history.append(record)
    return record


def run_rounds(setup: RoundSetup, engine: Engine, state: RunState, *, rounds: int, join_ratio: float,
               eval_every: int, callbacks: Sequence[Callback] = ()) -> RunState:
    """Continue ``state`` until ``rounds`` rounds are done and round ``rounds`` is evaluated."""
    for t in range(state.rounds_done + 1, rounds + 1):
        record = run_round(setup, engine, state, t, rounds=rounds, join_ratio=join_ratio, eval_every=eval_every)
        for cb in callbacks:
            cb.on_record(state, record)
    if not state.done:
        record = final_evaluation(setup, engine, state, rounds=rounds, join_ratio=join_ratio)
        for cb in callbacks:
            cb.on_record(state, record)
    return state

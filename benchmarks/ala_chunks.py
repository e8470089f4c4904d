"""The parallel engine's batched ALA step: chunk size vs time (docs/explanations/performance.md, "ALA on the
parallel engine").

    python benchmarks/ala_chunks.py --data-dir ../shared/datasets/mnist --clients 20 --repeats 3

FedALA's MNIST setting (Dir(0.1), FedAvgCNN, s = 80%, p = 1), parallel engine. Times the local
initialisation (``receive``) of every client of round 1 (ALA's start phase, up to 20 epochs) and
round 2 (steady, one epoch) for each chunk size with 1 intra-op thread and ``--workers`` workers,
beside the old scheme: all clients in one chunk with ``workers`` intra-op threads (whose numbers
depended on the worker count). Settings alternate within each repeat; medians are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from pflkit.algorithms import ClientSummary
from pflkit.bench import BENCH_TRAIN, bench_model, bench_session
from pflkit.data import PartitionSpec, load_dataset
from pflkit.data.federated import FederatedData
from pflkit.engines import ParallelEngine, RoundSetup
from pflkit.federation.session import RunSession


def receive_seconds(
    setup: RoundSetup, new_session: Callable[[], RunSession], engine: ParallelEngine, threads: int
) -> list[float]:
    """Seconds of the batched ``receive`` in rounds 1 and 2 (full rounds run between them) of a
    session from ``new_session``."""
    torch.set_num_threads(threads)
    session = new_session()
    seconds = []
    try:
        for _ in (1, 2):
            plan = session.next_plan()
            t0 = time.perf_counter()
            engine.receive(setup, plan.jobs, plan.round)
            seconds.append(time.perf_counter() - t0)
            torch.set_num_threads(1)
            session.finish(plan, engine.run(setup, plan.jobs, plan.round))
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(1)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunks", default="4,8,20", help="chunk sizes to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.clients
    data = FederatedData.build(
        load_dataset("mnist", args.data_dir), PartitionSpec(method="label_dirichlet", num_clients=n, alpha=0.1), 1
    )
    model, init, alg = bench_model(data, "fedala", 0, torch.device("cpu"))
    setup = RoundSetup(alg, data, model, model.units(), BENCH_TRAIN, 0)
    summaries = [ClientSummary(i, c.num_train, data.train_label_counts(i)) for i, c in enumerate(data.clients)]

    def new_session() -> RunSession:  # two training rounds, timed; no final pass
        return bench_session(alg, init, summaries, num_clients=n, rounds=2, final_pass=False)

    settings = {f"one chunk, {args.workers} threads (old)": (ParallelEngine(1, receive_chunk=n), args.workers)}
    for size in (int(c) for c in args.chunks.split(",")):
        settings[f"chunks of {size}, 1 thread, {args.workers} workers"] = (
            ParallelEngine(args.workers, receive_chunk=size),
            1,
        )
    times: dict[str, list[list[float]]] = {name: [] for name in settings}
    for repeat in range(args.repeats):
        names = list(settings) if repeat % 2 == 0 else list(reversed(settings))
        for name in names:
            engine, threads = settings[name]
            times[name].append(receive_seconds(setup, new_session, engine, threads))
    old = next(iter(times))
    medians = {name: [statistics.median(r[t] for r in rows) for t in (0, 1)] for name, rows in times.items()}
    out = {
        name: {
            "round1_start_phase_seconds": m[0],
            "round2_steady_seconds": m[1],
            "round1_vs_old": m[0] / medians[old][0],
            "round2_vs_old": m[1] / medians[old][1],
        }
        for name, m in medians.items()
    }
    print(json.dumps({"clients": n, "workers": args.workers, "repeats": args.repeats, "settings": out}, indent=1))
    for engine, _ in settings.values():
        engine.close()


if __name__ == "__main__":
    main()

"""Profile one steady round at N clients (docs/explanations/performance.md, "Where the per-client time goes").

    python benchmarks/profile_round.py --data-dir ../shared/datasets/mnist --clients 1000 --algorithm fedavg

MNIST's training set split over N equal clients (label-Dirichlet 0.1), loop engine, 1 thread, disk
store with a checkpoint after every round; rounds before the profiled one warm up.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch

from pflkit.algorithms import ClientSummary
from pflkit.bench import BENCH_TRAIN, bench_model, bench_session
from pflkit.data import PartitionSpec, load_dataset
from pflkit.data.federated import FederatedData
from pflkit.engines import RoundSetup, build_engine
from pflkit.federation.checkpoint import Checkpointer
from pflkit.federation.state_store import DiskStateStore


class Timer:
    """Callback: the time at which it is called (before and after the checkpoint writer)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_record(self, state: object, record: object) -> None:
        self.marks.append(time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--algorithm", default="fedavg")
    parser.add_argument("--round", type=int, default=2, help="the round profiled (earlier ones warm up)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.clients
    data = FederatedData.build(
        load_dataset("mnist", args.data_dir), PartitionSpec(method="label_dirichlet", num_clients=n, alpha=0.1), 1
    )
    model, init, alg = bench_model(data, args.algorithm, 0, torch.device("cpu"))
    setup = RoundSetup(alg, data, model, model.units(), BENCH_TRAIN, 0)
    engine = build_engine("loop")
    summaries = [ClientSummary(i, c.num_train, data.train_label_counts(i)) for i, c in enumerate(data.clients)]
    tmp = Path(tempfile.mkdtemp(prefix="pflkit-profile-"))
    timer = Timer()
    session = bench_session(
        alg,
        init,
        summaries,
        num_clients=n,
        rounds=args.round,
        final_pass=False,
        callbacks=[timer, Checkpointer(tmp / "checkpoint.pt", 1), timer],
        store=DiskStateStore(tmp / "states", n, lambda i: alg.init_client(init, i), cache=n),
    )

    def execute(jobs: list, round: int) -> list:
        results = engine.run(setup, jobs, round)
        timer.marks.append(time.perf_counter())
        return results

    for _ in range(1, args.round):
        session.step(execute)
    profile = cProfile.Profile()
    timer.marks = [time.perf_counter()]
    profile.enable()
    session.step(execute)
    profile.disable()
    t0, t1, t2, t3 = timer.marks  # start, clients done, driver done, checkpoint written
    p = session.state.pending
    print(
        f"{n} clients, {args.algorithm}: round {t3 - t0:.2f} s = clients {t1 - t0:.2f} s (init "
        f"{p.get('init_seconds', 0):.2f}, eval {p.get('eval_seconds', 0):.2f}, train {p.get('train_seconds', 0):.2f})"
        f" + driver {t2 - t1:.2f} s + checkpoint {t3 - t2:.2f} s"
    )
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(15)
    print(out.getvalue())


if __name__ == "__main__":
    main()

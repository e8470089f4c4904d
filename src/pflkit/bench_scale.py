"""``pflkit bench --scale``: what the number of clients costs at a fixed total of samples.

The same MNIST training set is split over 100, 1,000 and 10,000 clients with equal sizes
(label-Dirichlet, alpha 0.1: every client non-IID, all of one size, so that only the number of
clients changes). Each round trains every client up to ``participants`` (above that, a random
``participants`` of them, so the round's samples shrink with the join ratio and are reported).
Client states live in the disk store (``state_store = "disk"``) with the runs' default cache (the
clients of one round, at most 64: a state is read when its client's job starts), and every round
ends with a checkpoint, as in a real run. Rounds stream their results (``RunSession.step``), so the
peak memory of 1,000 FedAvg clients a round is that of the clients in flight, not of their uploads.

Each client count runs in its own process, so that its peak memory is its own; within it the
engines and algorithms are advanced round by round in turn (A B, B A, ...) so that machine drift
hits them alike, and the process measures the machine's batch-10 training rate at its start and
end: round times divided by that rate (``normalized``) compare across processes.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .algorithms import ClientSummary
from .bench import BENCH_TRAIN, _peak_memory_mb, _sync, bench_model, bench_session, mnist_like, single_model_limits
from .data import PartitionSpec, load_dataset
from .data.federated import FederatedData
from .engines import ClientJob, ClientResult, RoundSetup, build_engine
from .federation.checkpoint import Checkpointer
from .federation.session import RunJobs, on_engine
from .federation.state_store import DiskStateStore


@dataclass
class ScaleSettings:
    data_dir: str | None = None
    clients: list[int] = field(default_factory=lambda: [100, 1000, 10000])
    engines: list[str] = field(default_factory=lambda: ["parallel", "vmap"])
    algorithms: list[str] = field(default_factory=lambda: ["fedavg", "fedala"])
    rounds: int = 3
    participants: int = 1000
    workers: int | None = None
    device: str = "cpu"
    seed: int = 0
    state_dir: str | None = None  # default: a temporary folder, removed afterwards
    samples: int = 70_000  # size of the MNIST-shaped stand-in when no data_dir is given
    measure_limits: bool = True  # False: no single-model rates (quick checks; "normalized" is then NaN)


def scale_cell(settings: ScaleSettings, num_clients: int, state_dir: Path) -> dict[str, Any]:
    """One client count: every algorithm x engine for ``settings.rounds`` rounds, alternating."""
    torch.set_num_threads(1)
    device = torch.device(settings.device)
    dataset = load_dataset("mnist", settings.data_dir) if settings.data_dir else mnist_like(settings.samples)
    xs, ys = dataset.x[:2000].to(device), dataset.y[:2000].to(device)

    def limit() -> float:
        return single_model_limits(xs, ys, 1)["train_batch10"] if settings.measure_limits else float("nan")

    limit_before = limit()
    spec = PartitionSpec(method="label_dirichlet", num_clients=num_clients, alpha=0.1)
    data = FederatedData.build(dataset, spec, 1, device=device)
    del dataset
    join = min(1.0, settings.participants / num_clients)
    train = BENCH_TRAIN
    summaries = [ClientSummary(i, c.num_train, data.train_label_counts(i)) for i, c in enumerate(data.clients)]
    runs: dict[tuple[str, str], Any] = {}
    for name in settings.algorithms:
        for engine_name in settings.engines:
            model, init, alg = bench_model(data, name, settings.seed, device)
            folder = state_dir / f"{name}-{engine_name}"
            store = DiskStateStore(
                folder / "states",
                num_clients,
                functools.partial(alg.init_client, init),
                cache=min(64, max(1, int(join * num_clients))),
                device=device,
            )
            engine = build_engine(engine_name, workers=settings.workers, device=device.type)
            session = bench_session(
                alg,
                init,
                summaries,
                num_clients=num_clients,
                rounds=settings.rounds,
                final_pass=False,
                seed=settings.seed,
                join_ratio=join,
                store=store,
                callbacks=[Checkpointer(folder / "checkpoint.pt", every=1)],
            )
            setup = RoundSetup(alg, data, model, model.units(), train, settings.seed)
            runs[(name, engine_name)] = (on_engine(engine, setup), engine, session, store, folder, [])
    order = list(runs)
    for t in range(1, settings.rounds + 1):
        for key in order if t % 2 else list(reversed(order)):
            execute, engine, session, store, folder, rows = runs[key]
            jobs: list[int] = []

            def counted(
                round_jobs: list[ClientJob], round: int, execute: RunJobs = execute, jobs: list[int] = jobs
            ) -> Iterable[ClientResult]:
                jobs.extend(job.client_id for job in round_jobs)
                return execute(round_jobs, round)

            t0 = time.perf_counter()
            session.step(counted)  # the round, then its checkpoint
            _sync(device)
            rows.append(
                {
                    **session.state.pending,
                    "seconds_with_checkpoint": time.perf_counter() - t0,
                    "samples": sum(data.clients[j].num_train for j in jobs),
                    "participants": len(jobs),
                }
            )
    limit_after = limit()
    rate = (limit_before + limit_after) / 2
    out: dict[str, Any] = {
        "num_clients": num_clients,
        "join_ratio": join,
        "samples_per_client": data.clients[0].num_train,
        "train_samples": sum(c.num_train for c in data.clients),
        "limit_batch10_before": limit_before,
        "limit_batch10_after": limit_after,
        "runs": {},
    }
    for (name, engine_name), (_execute, engine, _session, store, folder, rows) in runs.items():
        engine.close()
        steady = rows[2:] if name != "fedavg" and len(rows) > 2 else rows[1:] or rows
        seconds = statistics.median(r["seconds_with_checkpoint"] for r in steady)
        samples = statistics.median(r["samples"] for r in steady)
        out["runs"][f"{name}/{engine_name}"] = {
            "round_seconds": [r["seconds_with_checkpoint"] for r in rows],
            "median_round_seconds": seconds,
            "samples_per_round": samples,
            "participants": steady[0]["participants"],
            "seconds_per_1k_samples": 1000 * seconds / samples,
            # the round in units of the same process's single-model batch-10 training time for its samples
            "normalized_round": seconds * rate / samples,
            "eval_seconds_client_sum": statistics.median(r.get("eval_seconds", 0.0) for r in steady),
            "init_seconds_client_sum": statistics.median(r.get("init_seconds", 0.0) for r in steady),
            "train_seconds_client_sum": statistics.median(r.get("train_seconds", 0.0) for r in steady),
            "state_bytes_on_disk": store.bytes_on_disk(),
            "state_files": sum(1 for _ in (folder / "states").glob("client*.pt")),
        }
    out.update(_peak_memory_mb(device))
    return out


def run_scale_bench(settings: ScaleSettings, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Every client count of ``settings`` in its own process; the per-client overhead against the
    smallest count."""
    report: dict[str, Any] = {"settings": asdict(settings), "cells": []}
    with tempfile.TemporaryDirectory(prefix="pflkit-scale-", dir=settings.state_dir) as tmp:
        for n in settings.clients:
            echo(f"scale: {n} clients ...")
            code = (
                "import json, sys; from pathlib import Path; from pflkit.bench_scale import ScaleSettings, "
                "scale_cell; s = ScaleSettings(**json.loads(sys.argv[1])); "
                "print(json.dumps(scale_cell(s, int(sys.argv[2]), Path(sys.argv[3]))))"
            )
            cell_dir = Path(tmp) / f"clients{n}"
            proc = subprocess.run(
                [sys.executable, "-c", code, json.dumps(asdict(settings)), str(n), str(cell_dir)],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"scale benchmark with {n} clients failed:\n{proc.stderr[-3000:]}")
            report["cells"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = report["cells"][0]
    for cell in report["cells"]:
        for key, run in cell["runs"].items():
            ref = base["runs"][key]
            run["cost_per_sample_vs_first"] = run["seconds_per_1k_samples"] / ref["seconds_per_1k_samples"]
            run["normalized_vs_first"] = run["normalized_round"] / ref["normalized_round"]
            expected = ref["median_round_seconds"] * run["samples_per_round"] / ref["samples_per_round"]
            run["per_client_overhead_ms"] = 1000 * (run["median_round_seconds"] - expected) / run["participants"]
    return report


def format_scale_report(report: dict[str, Any]) -> str:
    first = report["cells"][0]["num_clients"]
    header = (
        f"{'clients':>7} {'run':<16} {'clients/rnd':>11} {'samples/rnd':>11} {'s/round':>8} "
        f"{'s/1k smp':>8} {f'x vs {first}':>9} {'normalized':>10} {'ms/client':>9} {'state MB':>9} "
        f"{'peak RSS MB':>11}"
    )
    lines = [header, "-" * len(header)]
    for cell in report["cells"]:
        for key, run in cell["runs"].items():
            lines.append(
                f"{cell['num_clients']:>7} {key:<16} {run['participants']:>11} "
                f"{run['samples_per_round']:>11.0f} "
                f"{run['median_round_seconds']:>8.2f} {run['seconds_per_1k_samples']:>8.3f} "
                f"{run['cost_per_sample_vs_first']:>8.2f}x {run['normalized_vs_first']:>9.2f}x "
                f"{run['per_client_overhead_ms']:>9.1f} {run['state_bytes_on_disk'] / 1e6:>9.1f} "
                f"{cell['peak_rss_mb']:>11.0f}"
            )
    return "\n".join(lines)

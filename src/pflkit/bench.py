"""``pflkit bench``: time rounds of FedAvg and FedALA on every engine, in one run.

Engines are advanced round by round in alternating order (A B, B A, ...) so that machine noise
hits them alike; every number is a median over rounds, and throughput is reported next to the
same machine's single-model limits measured in the same run (batch-10 and large-batch training
with the threads the engines use).
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from .algorithms import Algorithm, ClientSummary, TrainSettings
from .config import BaseConfig, load_config
from .data import Dataset, PartitionError, PartitionSpec, load_dataset
from .data.federated import FederatedData
from .data.partition.spec import TestSet
from .engines import Engine, RoundSetup, build_engine, default_workers
from .federation.driver import Callback, RoundDriver
from .federation.evaluation import GlobalEvaluation
from .federation.preparation import initial_model, initial_params
from .federation.results import machine
from .federation.session import RunJobs, RunSession, on_engine
from .federation.state_store import ClientStore
from .functional import SGD, Batch, classification_loss, forward, net_of
from .functional.training import autograd_value_and_grad
from .methods import build_algorithm
from .models import UnitModel, build_model


@dataclass
class BenchSettings:
    data_dir: str | None = None
    clients: list[int] = field(default_factory=lambda: [20])
    engines: list[str] = field(default_factory=lambda: ["loop", "parallel"])
    algorithms: list[str] = field(default_factory=lambda: ["fedavg", "fedala"])
    rounds: int = 4
    workers: int | None = None
    device: str = "cpu"
    seed: int = 0
    test_set: TestSet = "client_split"  # "official": also time the global model's evaluation


def mnist_like(num: int = 70_000, seed: int = 0) -> Dataset:
    """MNIST-shaped stand-in (timing only) when no MNIST folder is given."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (num,), generator=g)
    means = torch.randn(10, 1, 28, 28, generator=g)
    x = (means[y] + torch.randn(num, 1, 28, 28, generator=g)).clamp(-1, 1)
    return Dataset("mnist-like", x, y, 10)


def _median_rate(fn: Callable[[], int], repeats: int = 5) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


def single_model_limits(x: torch.Tensor, y: torch.Tensor, threads: int) -> dict[str, float]:
    """Samples/s of one FedAvgCNN: training at batch 10 and 500, inference at batch 1000."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    model = build_model("fedavg_cnn", tuple(x.shape[1:]), 10).to(x.device)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    net, opt = net_of(model), SGD(0.1)
    step = autograd_value_and_grad(lambda tp, b: classification_loss(net, tp, b))

    def train(batch: int, steps: int) -> Callable[[], int]:
        def run() -> int:
            trained = {k: v.clone() for k, v in params.items()}
            for i in range(steps):
                grads, _ = step(trained, Batch(x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]))
                opt.update_(trained, grads, {})
            _sync(x.device)
            return batch * steps

        return run

    @torch.no_grad()
    def infer() -> int:
        for i in range(4):
            F.cross_entropy(forward(model, params, x[i * 1000 : (i + 1) * 1000]), y[i * 1000 : (i + 1) * 1000])
        _sync(x.device)
        return 4000

    train(10, 5)()
    out = {
        "train_batch10": _median_rate(train(10, 100)),
        "train_batch500": _median_rate(train(500, 4)),
        "inference_batch1000": _median_rate(infer),
    }
    torch.set_num_threads(previous)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_memory_mb(device: torch.device) -> dict[str, float]:
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def bench_data(
    dataset: Dataset, num_clients: int, test_set: TestSet, device: torch.device
) -> tuple[FederatedData, float, int]:
    """The benchmark partition of ``dataset`` over ``num_clients``: Dir(0.1) with PFLlib's minimum
    of 40 samples where feasible; (data, alpha, minimum) as used.

    PFLlib's minimum is infeasible for Dir(0.1) with hundreds of clients: it is halved (down to 2,
    so every client keeps a training sample after the 75/25 split), then alpha is raised."""
    min_samples, alpha = min(40, len(dataset) // num_clients // 2), 0.1
    while True:
        try:
            spec = PartitionSpec(
                num_clients=num_clients, alpha=alpha, min_samples_per_client=min_samples, test_set=test_set
            )
            return FederatedData.build(dataset, spec, 1, device=device), alpha, min_samples
        except PartitionError:
            if min_samples > 2:
                min_samples = max(2, min_samples // 2)
            elif alpha < 10:
                alpha *= 2
            else:
                raise


#: Local training of every benchmark: the FedALA MNIST setting's batch 10, one epoch, lr 0.1.
BENCH_TRAIN = TrainSettings(batch_size=10, local_epochs=1, lr=0.1, rounds=1)  # rounds: as recorded so far


def bench_model(
    data: FederatedData, algorithm: str, seed: int, device: torch.device
) -> tuple[UnitModel, dict[str, torch.Tensor], Algorithm]:
    """The benchmark's FedAvgCNN, its seeded Theta^0 (as every run makes it) and ``algorithm``
    with default settings."""
    model, init = initial_model("fedavg_cnn", data, seed, device)
    return (
        model,
        init,
        build_algorithm(algorithm, load_config(None, []).algorithm_sections(), BENCH_TRAIN, model.units()),
    )


def driver_rounds(rounds: int, final_pass: bool) -> int:
    """The rounds a benchmark's driver is told so that ``rounds`` steps of its session time what
    the benchmark means (see :func:`bench_session`): ``rounds`` with the final pass, one more
    without it."""
    return rounds if final_pass else rounds + 1


def bench_session(
    algorithm: Algorithm,
    init: dict[str, torch.Tensor],
    summaries: list[ClientSummary],
    *,
    num_clients: int,
    rounds: int,
    final_pass: bool,
    seed: int = 0,
    join_ratio: float = 1.0,
    global_evaluation: GlobalEvaluation | None = None,
    store: ClientStore | None = None,
    callbacks: Sequence[Callback] = (),
) -> RunSession:
    """The one way a benchmark (``pflkit bench``, ``bench --scale``, ``benchmarks/*.py``) opens a
    run: a fresh session of ``algorithm`` from ``init``, every round evaluated, that the benchmark
    steps ``rounds`` times (``session.step``, or ``next_plan`` and ``finish``) and times.

    ``final_pass`` says whether those steps end in the run's final pass, the evaluation of the last
    round with local initialisation and no training (``RoundDriver.plan_final``). False, what the
    benchmarks time: the driver is told ``rounds + 1`` rounds (:func:`driver_rounds`), so all
    ``rounds`` steps are training rounds and the final pass never comes (a run's evaluation
    schedule is the same: every round is evaluated). True: the driver's last training round is
    ``rounds`` and one more step runs the final pass, as a real run does. ``store`` and
    ``callbacks`` go to :meth:`RunSession.open` (the disk store, a checkpoint every round)."""
    driver = RoundDriver(
        algorithm,
        num_clients=num_clients,
        seed=seed,
        rounds=driver_rounds(rounds, final_pass),
        join_ratio=join_ratio,
        eval_every=1,
        global_evaluation=global_evaluation,
    )
    return RunSession.open(driver, init, summaries, store=store, callbacks=callbacks)


def method_run(
    config: BaseConfig, data: FederatedData, method: str, engine: Engine, rounds: int, device: torch.device
) -> tuple[RunSession, RunJobs]:
    """A fresh benchmark run of ``method`` on ``data`` with ``config``'s settings (seed 0): its
    session (:func:`bench_session`, ``rounds`` training rounds, no final pass) and what runs its
    client jobs on ``engine`` (the benchmark scripts' one way to start a method)."""
    summaries = [ClientSummary(i, c.num_train, data.train_label_counts(i)) for i, c in enumerate(data.clients)]
    model, init = initial_params(config, data, 0, device)
    alg = build_algorithm(method, config.algorithm_sections(), config.train, model.units())
    setup = RoundSetup(alg, data, model, model.units(), config.train, 0)
    session = bench_session(alg, init, summaries, num_clients=data.num_clients, rounds=rounds, final_pass=False)
    return session, on_engine(engine, setup)


def bench_partition(
    dataset: Dataset, num_clients: int, settings: BenchSettings, device: torch.device
) -> dict[str, Any]:
    """Alternate the engines round by round for each algorithm on one partition."""
    data, alpha, min_samples = bench_data(dataset, num_clients, settings.test_set, device)
    train = BENCH_TRAIN
    summaries = [ClientSummary(i, c.num_train, data.train_label_counts(i)) for i, c in enumerate(data.clients)]
    train_samples = sum(c.num_train for c in data.clients)
    out: dict[str, Any] = {
        "num_clients": num_clients,
        "train_samples": train_samples,
        "alpha": alpha,
        "min_samples_per_client": min_samples,
        "test_set": settings.test_set,
        "algorithms": {},
    }
    if data.global_test is not None:
        out["global_test_size"] = len(data.global_test[1])
    for name in settings.algorithms:
        runs: dict[str, tuple[RunJobs, Engine, RunSession, list[dict[str, Any]]]] = {}
        for engine_name in settings.engines:
            model, init, alg = bench_model(data, name, settings.seed, device)
            setup = RoundSetup(alg, data, model, model.units(), train, settings.seed)
            engine = build_engine(engine_name, workers=settings.workers, device=device.type)
            test = data.global_test
            evaluation = (
                None
                if test is None
                else GlobalEvaluation(
                    model,
                    *test,
                    data.num_classes,
                    np.stack([data.prior(i) for i in range(data.num_clients)]),
                    train.eval_batch_size,
                    workers=getattr(engine, "workers", 1),
                )
            )
            session = bench_session(
                alg,
                init,
                summaries,
                num_clients=data.num_clients,
                rounds=settings.rounds,
                final_pass=False,
                seed=settings.seed,
                global_evaluation=evaluation,
            )
            runs[engine_name] = (on_engine(engine, setup), engine, session, [])
        for t in range(1, settings.rounds + 1):
            order = settings.engines if t % 2 else list(reversed(settings.engines))
            for engine_name in order:
                execute, engine, session, rows = runs[engine_name]
                record = session.step(execute)
                _sync(device)
                # a training round (final_pass=False): it has a record and its training stats
                assert record is not None and session.state.pending is not None
                # the global evaluation of round t-1's state runs inside training round t
                rows.append(
                    {**session.state.pending, **{k: v for k, v in record.items() if k == "global_eval_seconds"}}
                )
        per_engine = {}
        for engine_name, (_execute, engine, session, rows) in runs.items():
            state = session.state
            engine.close()
            steady = rows[2:] if len(rows) > 2 else rows[1:]
            seconds = statistics.median(r["seconds"] for r in steady)
            client_compute = [
                r.get("init_seconds", 0) + r.get("train_seconds", 0) + r.get("eval_seconds", 0) for r in steady
            ]
            parallelism = getattr(engine, "workers", 1)
            train_busy = statistics.median(r.get("train_seconds", 0) for r in steady) / parallelism
            entry = {
                "round_seconds": [r["seconds"] for r in rows],
                "median_round_seconds": seconds,
                "train_samples_per_second": train_samples / seconds,
                # training only: samples over the time the workers spent in local training
                "training_samples_per_second": train_samples / train_busy if train_busy else None,
                "eval_seconds_client_sum": statistics.median(r.get("eval_seconds", 0) for r in steady),
                "init_share": statistics.median(r.get("init_seconds", 0) / c for r, c in zip(steady, client_compute)),
                "final_accuracy": state.history[-1]["accuracy"] if "accuracy" in state.history[-1] else None,
            }
            if all("global_eval_seconds" in r for r in steady):
                entry["global_eval_seconds"] = statistics.median(r["global_eval_seconds"] for r in steady)
                entry["global_eval_share"] = statistics.median(r["global_eval_seconds"] / r["seconds"] for r in steady)
            if len(rows) > 1 and "ala_epochs_max" in rows[1]:
                entry["start_phase_round_seconds"] = rows[1]["seconds"]
                entry["start_phase_ala_seconds_client_sum"] = rows[1]["init_seconds"]
                entry["start_phase_epochs_max"] = rows[1]["ala_epochs_max"]
                entry["steady_ala_seconds_client_sum"] = statistics.median(r["init_seconds"] for r in steady)
                entry["first_three_rounds_seconds"] = sum(r["seconds"] for r in rows[:3])
            per_engine[engine_name] = entry
        base = per_engine[settings.engines[0]]["median_round_seconds"]
        for entry in per_engine.values():
            entry["speedup_vs_" + settings.engines[0]] = base / entry["median_round_seconds"]
        out["algorithms"][name] = per_engine
    # ALA steady cost vs one no-grad forward pass over the same s% samples (large batch)
    model = build_model("fedavg_cnn", data.input_shape, data.num_classes).to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    start = time.perf_counter()
    with torch.no_grad():
        for c in data.clients:
            k = max(1, int(0.8 * c.num_train))
            forward(model, params, c.train_x[:k])
    _sync(device)
    out["no_grad_forward_over_ala_samples_seconds"] = time.perf_counter() - start
    out.update(_peak_memory_mb(device))
    return out


def run_bench(settings: BenchSettings, echo: Callable[[str], None] = print) -> dict[str, Any]:
    device = torch.device(settings.device)
    workers = settings.workers or default_workers()
    torch.set_num_threads(1)
    official = settings.test_set == "official"
    dataset = load_dataset("mnist", settings.data_dir, official_test=official) if settings.data_dir else mnist_like()
    xs, ys = dataset.x[:4000].to(device), dataset.y[:4000].to(device)
    report: dict[str, Any] = {
        "settings": {**settings.__dict__, "workers": workers, "dataset": dataset.name},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "description": machine(),
            "torch": torch.__version__,
            "cpus": default_workers(),
        },
        "limits_before": {
            "1_thread": single_model_limits(xs, ys, 1),
            f"{workers}_threads": single_model_limits(xs, ys, workers),
        },
        "partitions": [],
    }
    for n in settings.clients:
        echo(f"benchmarking {n} clients ...")
        report["partitions"].append(bench_partition(dataset, n, settings, device))
    report["limits_after"] = {
        "1_thread": single_model_limits(xs, ys, 1),
        f"{workers}_threads": single_model_limits(xs, ys, workers),
    }
    return report


def format_report(report: dict[str, Any]) -> str:
    workers = report["settings"]["workers"]
    limit = np.median([report[k][f"{workers}_threads"]["train_batch500"] for k in ("limits_before", "limits_after")])
    limit10 = np.median([report[k]["1_thread"]["train_batch10"] for k in ("limits_before", "limits_after")])
    lines = [
        f"single model, same run: batch-10 training {limit10:.0f} samples/s (1 thread); "
        f"batch-500 training {limit:.0f} samples/s ({workers} threads) = the large-batch limit"
    ]
    header = (
        f"{'clients':>7}  {'algorithm':<9} {'engine':<9} {'s/round':>8} {'speedup':>8} "
        f"{'round smp/s':>11} {'% of limit':>10} {'training smp/s':>14} {'% of limit':>10} "
        f"{'init share':>10} {'start round':>11}"
    )
    lines += [header, "-" * len(header)]
    for part in report["partitions"]:
        for alg, engines in part["algorithms"].items():
            for eng, e in engines.items():
                speed = next(v for k, v in e.items() if k.startswith("speedup_vs_"))
                start = e.get("start_phase_round_seconds")
                fedavg = part["algorithms"].get("fedavg", {}).get(eng, {}).get("median_round_seconds")
                start_txt = f"{start / fedavg:.2f} rnd" if start and fedavg else "-"
                training = e.get("training_samples_per_second") or float("nan")
                lines.append(
                    f"{part['num_clients']:>7}  {alg:<9} {eng:<9} {e['median_round_seconds']:>8.2f} "
                    f"{speed:>7.2f}x {e['train_samples_per_second']:>11.0f} "
                    f"{100 * e['train_samples_per_second'] / limit:>9.0f}% {training:>14.0f} "
                    f"{100 * training / limit:>9.0f}% {100 * e['init_share']:>9.1f}% {start_txt:>11}"
                )
                if "global_eval_share" in e:
                    lines.append(
                        f"{'':>7}  global-model evaluation on the {part['global_test_size']} official test "
                        f"samples: {e['global_eval_seconds']:.2f} s, {100 * e['global_eval_share']:.1f}% "
                        "of the round (median)"
                    )
        lines.append(
            f"{'':>7}  Dir({part['alpha']:g}), min {part['min_samples_per_client']} samples/client, "
            f"{part['train_samples']} training samples; peak RSS {part['peak_rss_mb']:.0f} MB"
        )
    return "\n".join(lines)


def save_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")

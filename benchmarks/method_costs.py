"""What each method's round costs against the work it must do (docs/explanations/performance.md).

FedALA's MNIST setting (configs/paper/mnist-dir0.1-all.toml: 20 clients, Dir(0.1), FedAvgCNN,
batch 10, one local epoch, every method with its Appendix G settings), the parallel engine. All
methods advance round by round in turn (A B C ..., then ... C B A) so that the machine's drift hits
them alike; a method's cost is the median of its steady rounds (round 3 on: round 2 is ALA's start
phase) divided by FedAvg's. Its *inherent work* is what it must compute, in FedAvg rounds
(``WORK``: training epochs over its data, and the forward passes it cannot avoid, a no-grad forward
counted as a third of a training step); the goal is a cost within 1.3x of it.

    python benchmarks/method_costs.py --data-dir ../shared/datasets/mnist --rounds 4 --out costs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pflkit.bench import driver_rounds, method_run
from pflkit.config import load_config
from pflkit.engines import build_engine
from pflkit.federation import build_partitions
from pflkit.federation.results import machine

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "paper" / "mnist-dir0.1-all.toml"
FORWARD = 1 / 3  # a no-grad forward pass, in training steps of the same samples

#: Inherent work per round in FedAvg rounds (one training epoch over every client's data = 1), with
#: the method's default (FedALA Appendix G) settings; the reason is printed with the table.
WORK = {
    "fedavg": (1.0, "1 epoch"),
    "fedprox": (1.0, "1 epoch (the proximal term is elementwise)"),
    "local": (1.0, "1 epoch"),
    "fedavgc": (2.0, "1 fine-tuning epoch + 1 epoch"),
    "fedproxc": (2.0, "1 fine-tuning epoch + 1 epoch"),
    "perfedavg": (2.0, "each step trains on two batches (B, B')"),
    "fedrep": (
        1.0 + FORWARD + 5 * 0.1,
        "1 body epoch + 1 forward for the features + 5 head-only epochs (~0.1 each on cached features)",
    ),
    "pfedme": (5.0, "K = 5 inner steps per batch"),
    "ditto": (3.0, "1 global epoch + 2 personal epochs"),
    "fedamp": (1.0, "1 epoch"),
    "fedphp": (1.0 + FORWARD, "1 epoch + the HPM's forward for the MMD"),
    "fedfomo": (1.0 + 19 * 0.2 * FORWARD, "1 epoch + 19 downloaded models scored on a 20% holdout"),
    "apple": (1.0, "1 epoch (plus mixing 20 downloaded models at every step)"),
    "partialfed": (1.0, "1 epoch (model and strategy batches)"),
    "fedala": (1.0 + 0.8 * FORWARD, "1 epoch + one forward over the s = 80% sample (steady ALA)"),
    "fedper": (1.0, "1 epoch"),
    "fedbn": (1.0, "1 epoch (batch norm stays on the client)"),
    "lgfedavg": (1.0, "1 epoch"),
    "fedbabu": (6.0, "1 body epoch + 5 fine-tuning epochs before every scoring"),
    "apfl": (2.0, "per batch, a step of w on f(w) and one of v and alpha on the mixture"),
    "scaffold": (1.0, "1 epoch (the correction is elementwise)"),
    "feddyn": (1.0, "1 epoch (the linear and proximal terms are elementwise)"),
    "moon": (1.0 + 2 * FORWARD, "1 epoch + the received and the previous model's forwards"),
    "fedavgm": (1.0, "1 epoch"),
    "fedadam": (1.0, "1 epoch"),
    "fedyogi": (1.0, "1 epoch"),
    "fedadagrad": (1.0, "1 epoch"),
    "fedproto": (1.0, "1 epoch"),
    "fedgh": (1.0 + FORWARD, "1 epoch + 1 forward for the prototypes (the server's head epoch is small)"),
    "fedpac": (1.0 + 2 * FORWARD, "1 body epoch + the head epoch's body forward + 1 forward for the statistics"),
    "feddbe": (1.0, "1 epoch"),
    "fedcp": (1.0 + FORWARD, "1 epoch + the received body's forward for the MMD"),
    "gpfl": (1.0, "1 epoch"),
    "fedcac": (1.0, "1 epoch (the masks are elementwise)"),
    "fedas": (
        3.0 + FORWARD,
        "1 forward for the prototypes + 1 alignment epoch + 1 epoch + 1 backward pass for the Fisher trace",
    ),
}
METHODS = list(WORK)


def report(runs: dict[str, list[dict]], rounds: int, workers: int, steady_from: int, model: str | None = None) -> dict:
    """The costs file: per method its rounds' wall times (``rows``: one dict per round, ``wall`` and
    the driver's ``*_seconds``), the median of its steady rounds (``steady_from`` on) and that over
    FedAvg's and over its inherent work; ``model``: the model every method ran on, where not the
    setting's."""
    first = steady_from - 1
    out = {
        "config": str(CONFIG.name),
        **({"model": model} if model else {}),
        "machine": machine(),
        "rounds": rounds,
        "workers": workers,
        "steady_from": steady_from,
        "methods": {},
    }
    short = next((name for name, rows in runs.items() if len(rows) < steady_from), None)
    if short is not None:
        raise SystemExit(f"{short}: no round from {steady_from} on among its {len(runs[short])}")
    base = statistics.median(r["wall"] for r in runs["fedavg"][first:]) if "fedavg" in runs else None
    for name, rows in runs.items():
        steady = rows[first:]
        seconds = statistics.median(r["wall"] for r in steady)
        work, why = WORK.get(name.split("+")[0], (float("nan"), "?"))
        entry = {
            "round_seconds": [r["wall"] for r in rows],
            "steady_seconds": seconds,
            **{
                key: statistics.median(r.get(key, 0.0) for r in steady)
                for key in ("init_seconds", "train_seconds", "eval_seconds")
            },
            "inherent_work": work,
            "work": why,
        }
        if base:
            entry["cost_vs_fedavg"] = seconds / base
            entry["cost_vs_inherent"] = seconds / (base * work)
        out["methods"][name] = entry
    return out


def rescore(path: Path, steady_from: int) -> dict:
    """An earlier costs file scored again from its ``round_seconds`` with other steady rounds (the
    per-phase medians kept: the file holds no per-round phases)."""
    old = json.loads(path.read_text())
    runs = {
        name: [
            {"wall": w, **{k: m.get(k, 0.0) for k in ("init_seconds", "train_seconds", "eval_seconds")}}
            for w in m["round_seconds"]
        ]
        for name, m in old["methods"].items()
    }
    return report(runs, old["rounds"], old["workers"], steady_from, old.get("model"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--steady-from",
        type=int,
        default=3,
        help="the first steady round (3: round 2 is ALA's start phase; 2 for methods without ALA, whose "
        "rounds 2 and 3 then run in opposite orders so that a linear drift of the machine cancels)",
    )
    parser.add_argument(
        "--model",
        help="run every method on this model instead of the setting's fedavg_cnn (FedBN's cost: "
        "--model fedavg_cnn_bn --methods fedavg,fedbn, against FedAvg on the same model)",
    )
    parser.add_argument("--rescore", type=Path, help="score an earlier --out file again (no run)")
    parser.add_argument("--out", type=Path, default=Path("method-costs.json"))
    args = parser.parse_args(argv)
    if args.rescore:
        result = rescore(args.rescore, args.steady_from)
    else:
        if not args.data_dir:
            parser.error("--data-dir is required (the MNIST folder) unless --rescore is given")
        result = report(measure(args), args.rounds, args.workers, args.steady_from, args.model)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'method':<14} {'s/round':>8} {'x FedAvg':>9} {'inherent':>9} {'x inherent':>11}  work")
    for name, e in result["methods"].items():
        print(
            f"{name:<14} {e['steady_seconds']:>8.1f} {e.get('cost_vs_fedavg', float('nan')):>8.2f}x "
            f"{e['inherent_work']:>8.2f}x {e.get('cost_vs_inherent', float('nan')):>10.2f}x  {e['work']}"
        )
    return 0


def measure(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every method's rounds, advanced in turn (A B C ..., then ... C B A): per round its record and wall time."""
    torch.set_num_threads(1)
    methods = args.methods.split(",")
    rounds = driver_rounds(args.rounds, final_pass=False)  # the config's rounds are the driver's
    config = load_config(
        str(CONFIG),
        [
            f"data_dir={args.data_dir}",
            f"rounds={rounds}",
            "seeds=[0]",
            f"algorithms={json.dumps(methods)}",
            f"workers={args.workers}",
            *([f"model={json.dumps(args.model)}"] if args.model else []),
        ],
    )
    device = torch.device("cpu")
    config, partitions = build_partitions(config, device)
    data = next(iter(partitions.values()))
    engine = build_engine("parallel", workers=args.workers, device="cpu")
    runs = {}
    for name in methods:
        session, execute = method_run(config, data, name, engine, args.rounds, device)
        runs[name] = (session, execute, [])
    failed: dict[str, str] = {}
    try:
        for t in range(1, args.rounds + 1):
            for name in methods if t % 2 else methods[::-1]:
                if name in failed:
                    continue
                session, execute, rows = runs[name]
                start = time.perf_counter()
                try:
                    session.step(execute)
                except Exception as exc:  # a method that fails leaves the others' measurement standing
                    failed[name] = f"round {t}: {type(exc).__name__}: {exc}"
                    print(f"round {t} {name}: failed, left out ({failed[name]})", file=sys.stderr, flush=True)
                    continue
                rows.append({**session.state.pending, "wall": time.perf_counter() - start})
                print(f"round {t} {name}: {rows[-1]['wall']:.1f} s", file=sys.stderr, flush=True)
    finally:
        engine.close()
    if failed:
        print(f"left out: {failed}", file=sys.stderr)
    return {name: rows for name, (_session, _execute, rows) in runs.items() if name not in failed}


if __name__ == "__main__":
    sys.exit(main())

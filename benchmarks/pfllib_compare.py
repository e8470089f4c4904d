"""A round of each method pflkit and PFLlib both have, in both libraries, on the same CPU, in one run.

FedALA's MNIST setting (configs/paper/mnist-dir0.1-all.toml: 20 clients, Dir(0.1), FedAvgCNN,
batch 10, one local epoch, lr 0.1, every client every round, evaluated every round). The partition is
drawn once by pflkit and written in PFLlib's format (``dataset/MNIST/{train,test}/<i>.npz``), so that
both libraries train on the same samples. PFLlib runs as its users run it (its ``main.py``, one
process per method, at its best thread count: ``--pfllib-threads`` are tried on FedAvg first); pflkit
runs its parallel engine. Methods take turns, and which library goes first alternates from method to
method, so that the machine's drift hits both alike. A method's round is the median of its steady
rounds (``--steady-from``; FedALA's from 3: round 2 is its start phase in both libraries).

Two ratios per method (PFLlib's round over pflkit's):
- ``as_run``: each library's round as it runs by default;
- ``equal_work``: PFLlib's round without the pass over every client's training data that its
  evaluation adds to every round (pflkit reports the training loss of the epoch it trained), so
  that both rounds train the same clients for the same epochs and score the same test splits.

    python benchmarks/pfllib_compare.py --pfllib ~/PFLlib --data-dir ../shared/datasets/mnist \\
        --out docs/pfllib-compare.json

PFLlib's code is never copied: ``--pfllib`` is a checkout of github.com/TsingZ0/PFLlib, and its
``main.py`` needs ``h5py``, ``scikit-learn``, ``cvxpy`` and ``calmsize`` in this environment.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pflkit.bench import driver_rounds, method_run
from pflkit.config import load_config
from pflkit.data.federated import FederatedData
from pflkit.engines import build_engine
from pflkit.federation import build_partitions
from pflkit.federation.results import machine

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "configs" / "paper" / "mnist-dir0.1-all.toml"

#: What PFLlib's main.py imports beyond torch and NumPy (module -> package), torchvision aside.
PFLLIB_NEEDS = {"h5py": "h5py", "sklearn": "scikit-learn", "cvxpy": "cvxpy", "calmsize": "calmsize"}

#: pflkit method -> (PFLlib's ``-algo``, PFLlib flags that give it pflkit's default settings (those
#: that change the work: inner steps, epochs, models sent), pflkit overrides, what differs).
METHODS: dict[str, tuple[str, list[str], list[str], str]] = {
    "fedavg": ("FedAvg", [], [], ""),
    "fedprox": ("FedProx", ["-mu", "0.001"], [], ""),
    "perfedavg": ("PerAvg", ["-bt", "0.001"], [], ""),
    "fedrep": ("FedRep", ["-pls", "5"], [], ""),
    "pfedme": ("pFedMe", ["-K", "5", "-lrp", "0.01", "-lam", "15", "-bt", "1"], [], ""),
    "ditto": ("Ditto", ["-mu", "0.1", "-pls", "2"], [], ""),
    "fedamp": ("FedAMP", ["-alk", "1000", "-lam", "1", "-sg", "0.1"], [], ""),
    "fedphp": ("FedPHP", ["-mu", "0.9", "-lam", "0.01"], [], ""),
    "fedfomo": ("FedFomo", ["-M", "20"], [], "PFLlib sends the top 20 models, the client's own among them"),
    "apple": ("APPLE", ["-dlr", "0.01", "-mu", "0.1", "-L", "0.2"], [], ""),
    "fedala": ("FedALA", ["-et", "1", "-s", "80", "-p", "1"], [], ""),
    "fedper": ("FedPer", [], [], ""),
    "lgfedavg": ("LG-FedAvg", [], [], ""),
    "fedbabu": (
        "FedBABU",
        ["-fte", "5"],
        ["fedbabu.ft_epochs=1"],
        "unequal: PFLlib fine-tunes only after the last round, pflkit before every scoring (here 1 epoch, "
        "its least), so pflkit's round trains 2 epochs to PFLlib's 1",
    ),
    "apfl": ("APFL", ["-al", "0.5"], [], ""),
    "scaffold": ("SCAFFOLD", ["-slr", "1"], [], ""),
    "feddyn": ("FedDyn", ["-al", "0.01"], [], ""),
    "moon": ("MOON", ["-mu", "1", "-tau", "0.5"], [], ""),
    "fedrod": ("FedROD", [], [], ""),
    "fedproto": ("FedProto", ["-lam", "1"], [], ""),
    "fedgh": ("FedGH", ["-slr", "1"], [], ""),
    "feddbe": ("FedDBE", ["-mo", "1", "-klw", "50"], [], ""),
    "fedcp": ("FedCP", ["-lam", "5"], [], ""),
    "gpfl": ("GPFL", ["-lam", "0.01", "-mu", "0.1"], [], ""),
    "fedcac": ("FedCAC", ["-tau", "0.5", "-bt", "100"], [], ""),
    "fedas": ("FedAS", [], [], ""),
    "fedpac": ("FedPAC", ["-lam", "1"], [], ""),
    "fedntd": ("FedNTD", ["-bt", "1", "-tau", "1"], [], ""),
    "fedlc": ("FedLC", ["-tau", "1"], [], ""),
    "local": ("Local", [], [], ""),
}
#: The methods of the first comparison: PFLlib's methods that FedALA compares with, and the baselines.
#: ``--methods`` takes any of ``METHODS``; ``REPRESENTATION`` lists the second comparison's.
DEFAULT = [
    "fedavg", "fedprox", "perfedavg", "fedrep", "pfedme", "ditto", "fedamp", "fedphp", "fedfomo", "apple",
    "fedala", "fedper", "lgfedavg", "fedbabu", "apfl", "scaffold", "feddyn", "moon",
]  # fmt: skip
REPRESENTATION = [
    "fedrod", "fedntd", "fedlc", "fedproto", "fedpac", "fedgh", "feddbe", "fedcp", "gpfl", "fedcac", "fedas", "local",
]  # fmt: skip


def export_pfllib(data: FederatedData, root: Path) -> None:
    """``data``'s clients in PFLlib's folder format under ``root`` (``config.json``, ``train/<i>.npz``,
    ``test/<i>.npz``, each a pickled ``{"x", "y"}`` under the key ``data``)."""
    for split in ("train", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
    for i, client in enumerate(data.clients):
        for split, x, y in (("train", client.train_x, client.train_y), ("test", client.test_x, client.test_y)):
            record = {"x": x.cpu().numpy().astype(np.float32), "y": y.cpu().numpy().astype(np.int64)}
            np.savez_compressed(root / split / f"{i}.npz", data=record)
    (root / "config.json").write_text(
        json.dumps({"num_clients": data.num_clients, "num_classes": data.num_classes, "source": "pflkit"})
    )


def pfllib_rounds(args: argparse.Namespace, work: Path, method: str, threads: int) -> list[dict]:
    """PFLlib's rounds of ``method`` (``wall`` and ``train_loss_pass`` seconds each), in a fresh process."""
    algo, flags, _overrides, _note = METHODS[method]
    common = ["-data", "MNIST", "-m", "CNN", "-nc", "20", "-jr", "1", "-lbs", "10", "-ls", "1", "-lr", "0.1"]
    common += ["-gr", str(args.rounds - 1), "-eg", "1", "-dev", "cpu", "-t", "1", "-algo", algo]
    out = work / f"pfllib-{method}-{threads}.json"
    command = [sys.executable, str(HERE / "pfllib_rounds.py"), "--pfllib", str(args.pfllib), "--workdir", str(work)]
    command += ["--threads", str(threads), "--out", str(out), "--", *common, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"PFLlib {algo} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())["rounds"]


class Pflkit:
    """pflkit's side: the setting's partition and a parallel engine, a fresh run per method."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.set_num_threads(1)
        self.args = args
        self.device = torch.device("cpu")
        _config, partitions = build_partitions(self.config_for("fedavg"), self.device)
        self.data = next(iter(partitions.values()))
        self.engine = build_engine("parallel", workers=args.workers, device="cpu")

    def config_for(self, method: str):
        """The setting's config for ``method`` alone, with its overrides (``METHODS``)."""
        rounds = driver_rounds(self.args.rounds, final_pass=False)
        settings = [f"data_dir={self.args.data_dir}", f"rounds={rounds}", "seeds=[0]", f"workers={self.args.workers}"]
        return load_config(str(CONFIG), [*settings, f"algorithms={json.dumps([method])}", *METHODS[method][2]])

    def rounds(self, method: str) -> list[dict]:
        """pflkit's rounds of ``method`` (``wall`` seconds each), a fresh run."""
        session, execute = method_run(
            self.config_for(method), self.data, method, self.engine, self.args.rounds, self.device
        )
        rows = []
        for _ in range(self.args.rounds):
            start = time.perf_counter()
            session.step(execute)
            rows.append({"wall": time.perf_counter() - start})
        return rows


def steady(rows: list[dict], first: int, key: str = "wall") -> float:
    """The median of ``key`` over the rounds from ``first`` (1-based) on."""
    return statistics.median(r[key] for r in rows[first - 1 :])


def entry(method: str, pfllib: list[dict], pflkit: list[dict], first: int) -> dict:
    """A method's record: both libraries' round times and the two ratios of their steady medians.
    ``pfllib`` rows hold ``wall`` and ``train_loss_pass`` seconds, ``pflkit`` rows ``wall``."""
    theirs = steady(pfllib, first)
    bare = statistics.median(r["wall"] - r["train_loss_pass"] for r in pfllib[first - 1 :])
    ours = steady(pflkit, first)
    algo, flags, overrides, note = METHODS[method]
    return {
        "pfllib_algorithm": algo,
        "pfllib_flags": flags,
        "pflkit_overrides": overrides,
        "note": note,
        "steady_from": first,
        "pfllib_round_seconds": [r["wall"] for r in pfllib],
        "pfllib_train_loss_pass_seconds": [r["train_loss_pass"] for r in pfllib],
        "pflkit_round_seconds": [r["wall"] for r in pflkit],
        "pfllib_steady": theirs,
        "pflkit_steady": ours,
        "as_run": theirs / ours,
        "pfllib_steady_without_pass": bare,
        "equal_work": bare / ours,
    }


def rescore(path: Path) -> dict:
    """A result file's records computed again from its round times (what the committed file must equal)."""
    old = json.loads(path.read_text())
    methods = {}
    for name, m in old["methods"].items():
        if "failed" in m:
            methods[name] = m
            continue
        pfllib = [
            {"wall": w, "train_loss_pass": p}
            for w, p in zip(m["pfllib_round_seconds"], m["pfllib_train_loss_pass_seconds"], strict=True)
        ]
        pflkit = [{"wall": w} for w in m["pflkit_round_seconds"]]
        methods[name] = entry(name, pfllib, pflkit, m["steady_from"])
    return {**old, "methods": methods}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pfllib", type=Path, help="a PFLlib checkout (holds system/main.py)")
    parser.add_argument("--data-dir", help="the MNIST folder")
    parser.add_argument("--methods", default=",".join(DEFAULT), help=f"of {', '.join(METHODS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steady-from", type=int, default=2, help="the first steady round (FedALA's: one later)")
    parser.add_argument("--workers", type=int, default=2, help="pflkit's parallel workers")
    parser.add_argument("--pfllib-threads", default="1,2", help="thread counts to try for PFLlib on FedAvg")
    parser.add_argument("--out", type=Path, default=Path("pfllib-compare.json"))
    parser.add_argument("--table", type=Path, help="print the ratio table of an earlier --out file (no run)")
    args = parser.parse_args(argv)
    if args.table:
        print(table(rescore(args.table)))
        return 0
    if args.pfllib is None or args.data_dir is None:
        parser.error("--pfllib and --data-dir are required unless --table is given")
    args.pfllib = args.pfllib.resolve()
    if not (args.pfllib / "system" / "main.py").is_file():
        parser.error(f"{args.pfllib} is no PFLlib checkout: it lacks system/main.py")
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if args.rounds < args.steady_from + 1:
        parser.error("--rounds must reach FedALA's steady round (--steady-from + 1)")
    missing = [package for module, package in PFLLIB_NEEDS.items() if importlib.util.find_spec(module) is None]
    if missing:
        parser.error(f"PFLlib's main.py needs {', '.join(missing)}: pip install {' '.join(missing)}")

    pflkit = Pflkit(args)
    with tempfile.TemporaryDirectory(prefix="pfllib-compare-") as tmp:
        work = Path(tmp)
        export_pfllib(pflkit.data, work / "dataset" / "MNIST")
        tried = {}
        for threads in (int(t) for t in args.pfllib_threads.split(",")):
            tried[threads] = steady(pfllib_rounds(args, work, "fedavg", threads), args.steady_from)
            print(f"PFLlib FedAvg at {threads} threads: {tried[threads]:.1f} s a round", file=sys.stderr, flush=True)
        threads = min(tried, key=tried.__getitem__)
        results = {}
        for k, method in enumerate(methods):
            first = args.steady_from + (method == "fedala")
            try:
                sides = ("pfllib", "pflkit") if k % 2 == 0 else ("pflkit", "pfllib")
                rows = {}
                for side in sides:
                    rows[side] = (
                        pfllib_rounds(args, work, method, threads) if side == "pfllib" else pflkit.rounds(method)
                    )
            except Exception as exc:  # one method's failure leaves the others' measurement standing
                print(f"{method}: failed, left out: {exc}", file=sys.stderr, flush=True)
                results[method] = {"failed": str(exc)[-1500:]}
                continue
            results[method] = e = entry(method, rows["pfllib"], rows["pflkit"], first)
            record(args, threads, tried, results)  # a run that stops keeps the methods it finished
            print(
                f"{method}: PFLlib {e['pfllib_steady']:.1f} s ({e['pfllib_steady_without_pass']:.1f} s without "
                f"its training-loss pass), pflkit {e['pflkit_steady']:.1f} s: {e['as_run']:.2f}x as run, "
                f"{e['equal_work']:.2f}x equal work",
                file=sys.stderr,
                flush=True,
            )
    pflkit.engine.close()
    out = record(args, threads, tried, results)
    print(table(out))
    return 0


def record(args: argparse.Namespace, threads: int, tried: dict[int, float], results: dict) -> dict:
    """The result file (written to ``--out``): the setting, PFLlib's commit and thread counts, the methods."""
    commit = subprocess.run(["git", "-C", str(args.pfllib), "rev-parse", "HEAD"], capture_output=True, text=True)
    out = {
        "config": CONFIG.name,
        "pfllib_commit": commit.stdout.strip() or "unknown",
        "rounds": args.rounds,
        "pflkit_engine": f"parallel, {args.workers} workers, 1 thread each",
        "pfllib_threads": threads,
        "pfllib_fedavg_by_threads": tried,
        "cpu_count": os.cpu_count(),
        "machine": machine(),
        "torch": torch.__version__,
        "methods": results,
    }
    args.out.write_text(json.dumps(out, indent=2))
    return out


def table(result: dict) -> str:
    """The ratio table (Markdown) of a result file."""
    lines = [
        "| method | PFLlib round (s) | without its training-loss pass (s) | pflkit round (s) | as run | equal work |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in result["methods"].items():
        if "failed" in m:
            lines.append(f"| {name} | failed | | | | |")
            continue
        lines.append(
            f"| {name} | {m['pfllib_steady']:.1f} | {m['pfllib_steady_without_pass']:.1f} | {m['pflkit_steady']:.1f} | "
            f"{m['as_run']:.2f}x | {m['equal_work']:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Run PFLlib's own ``main.py`` for a few rounds and write when each round began and ended.

Called by ``benchmarks/pfllib_compare.py`` in a fresh process, one per method:

    python benchmarks/pfllib_rounds.py --pfllib DIR --workdir WORK --threads 2 --out t.json -- -algo FedAvg -gr 2

PFLlib reads its data from ``../dataset/<name>/`` relative to the working directory, so the
process runs in ``WORK/system`` with the exported partition in ``WORK/dataset``. Nothing of PFLlib
is changed: its server class's ``select_clients`` (the first call of every round) is wrapped to take
timestamps, and its ``__init__`` to keep the server, whose ``Budget`` (PFLlib's own time of each
round) ends the last round; a server without one ends it at ``save_results``. (PFLlib's FedBABU
fine-tunes every client after the last round and before ``save_results``: that is no round's work.)
Its ``train_metrics``
(the pass over every client's training data that PFLlib's evaluation adds to each round) to time
that pass. PFLlib's ``main.py`` imports torchvision only for models this benchmark does not use;
where torchvision is not installed an empty module stands in for it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import runpy
import sys
import time
import types
from pathlib import Path


def wrap(cls: type, name: str, record: list[float] | list[tuple[float, float]], span: bool) -> None:
    """Record each call of ``cls.name``: its start time, or (start, end) with ``span``."""
    original = cls.__dict__[name]

    @functools.wraps(original)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        if not span:
            record.append(start)  # type: ignore[arg-type]
            return original(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        finally:
            record.append((start, time.perf_counter()))  # type: ignore[arg-type]

    setattr(cls, name, timed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pfllib", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags

    import torch

    torch.set_num_threads(args.threads)
    system = (args.pfllib / "system").resolve()
    sys.path.insert(0, str(system))
    try:
        import torchvision  # noqa: F401
    except ImportError:
        sys.modules["torchvision"] = types.ModuleType("torchvision")
    base = importlib.import_module("flcore.servers.serverbase").Server
    starts: list[float] = []
    ends: list[float] = []
    passes: list[tuple[float, float]] = []
    servers: list[object] = []
    original_init = base.__init__

    def keep(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        servers.append(self)
        original_init(self, *args, **kwargs)

    base.__init__ = keep
    wrap(base, "select_clients", starts, span=False)
    wrap(base, "save_results", ends, span=False)
    wrap(base, "train_metrics", passes, span=True)
    for module, cls_name in (("serverpFedMe", "pFedMe"), ("serverditto", "Ditto")):
        cls = getattr(importlib.import_module(f"flcore.servers.{module}"), cls_name)
        for name in ("save_results", "train_metrics_personalized"):
            if name in cls.__dict__:
                wrap(cls, name, ends if name == "save_results" else passes, span=name != "save_results")

    run_dir = args.workdir / "system"
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chdir(run_dir)
    sys.argv = [str(system / "main.py"), *flags]
    runpy.run_path(str(system / "main.py"), run_name="__main__")

    if not starts or not ends:
        raise SystemExit(f"PFLlib ran no round (select_clients called {len(starts)} times, save_results {len(ends)})")
    expected = int(flags[flags.index("-gr") + 1]) + 1 if "-gr" in flags else len(starts)
    if len(starts) % expected:
        raise SystemExit(f"select_clients was called {len(starts)} times in {expected} rounds")
    firsts = starts[:: len(starts) // expected]  # PFLlib's Local selects twice a round
    budget = list((getattr(servers[-1], "Budget", None) if servers else None) or [])
    if len(budget) == expected:
        windows = [(begin, begin + b) for begin, b in zip(firsts, budget)]
    else:
        windows = list(zip(firsts, [*firsts[1:], ends[0]]))
    # A pass belongs to the round whose select_clients it follows; the next round's first call
    # bounds it too, since a Budget-ended window can reach past it when the process was preempted
    # between the server's own clock read and the wrapper's.
    bounds = [*firsts[1:], float("inf")]
    rounds = []
    for (begin, end), following in zip(windows, bounds):
        inside = sum(b - a for a, b in passes if begin <= a < min(end, following))
        rounds.append({"wall": end - begin, "train_loss_pass": inside})
    args.out.write_text(json.dumps({"threads": args.threads, "flags": flags, "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

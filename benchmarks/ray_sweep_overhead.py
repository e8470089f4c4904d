"""What a Ray sweep costs over a local one: the same 4 digits cells (docs/tutorials/deploy-flower.md,
"Sweeps on a Ray cluster").

    python benchmarks/ray_sweep_overhead.py [--repeats 2]

Each repeat runs the grid locally (one cell after another in this process), then as Ray tasks on a
one-CPU Ray head started on 127.0.0.1 (one cell at a time, so the difference is Ray's overhead:
connecting, shipping each cell, a fresh worker process importing pflkit), then on a Ray instance
with every core (cells side by side). Medians of the wall times; every sweep is a fresh folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pflkit.run.sweep import run_sweep

GRID = ["rounds=12", "num_clients=6", 'algorithms=["fedavg", "fedala"]', "lr=[0.05,0.1]", "seeds=[[0],[1]]"]
RAY = Path(sys.executable).parent / "ray"


def timed(folder: Path, **kwargs: object) -> float:
    t0 = time.perf_counter()
    run_sweep(None, GRID, folder, progress=False, echo=lambda s: None, **kwargs)  # type: ignore[arg-type]
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    env = {**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    out: dict[str, list[float]] = {"local": [], "ray, 1-CPU head": [], "ray, every core": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            out["local"].append(timed(Path(tmp) / f"local{r}"))
            temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
            subprocess.run(
                [
                    str(RAY),
                    "start",
                    "--head",
                    "--node-ip-address=127.0.0.1",
                    "--port=6391",
                    "--num-cpus=1",
                    "--include-dashboard=false",
                    f"--temp-dir={temp}",
                    "--disable-usage-stats",
                ],
                env=env,
                check=True,
                capture_output=True,
            )
            try:
                out["ray, 1-CPU head"].append(timed(Path(tmp) / f"head{r}", executor="ray", address="127.0.0.1:6391"))
            finally:
                subprocess.run([str(RAY), "stop", "--force"], env=env, capture_output=True)
                shutil.rmtree(temp, ignore_errors=True)
            out["ray, every core"].append(timed(Path(tmp) / f"all{r}", executor="ray"))
    base = statistics.median(out["local"])
    report = {
        k: {"seconds": v, "median": statistics.median(v), "vs_local": statistics.median(v) / base}
        for k, v in out.items()
    }
    print(json.dumps({"cells": 4, "grid": GRID, "cpus": os.cpu_count(), "runs": report}, indent=1))


if __name__ == "__main__":
    main()

"""Run summaries: per-run metrics from the round history, their mean/std over seeds, a table.

Definitions (see docs/metrics.md):
  accuracy              pooled over the evaluated clients' test samples: sum correct / sum samples
  mean_client_accuracy  unweighted mean over evaluated clients of correct_i / n_i
  best_*                maximum over evaluated rounds (round 0 = initial model included)
  final_*               value at the last round T
  mean_seconds_per_round  mean wall-clock of training rounds 1..T (local init incl. ALA,
                        evaluation, training, aggregation; not checkpoint I/O)
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

RUN_METRICS = ("best_accuracy", "final_accuracy", "best_mean_client_accuracy", "final_mean_client_accuracy",
               "mean_seconds_per_round")


def run_metrics(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    evaluated = [r for r in history if "accuracy" in r]
    if not evaluated:
        raise ValueError("history holds no evaluated round")
    best = max(evaluated, key=lambda r: r["accuracy"])
    seconds = [r["seconds"] for r in history if "seconds" in r]
    last = evaluated[-1]
    return {
        "best_accuracy": best["accuracy"],
        "best_round": best["round"],
        "final_accuracy": last["accuracy"],
        "best_mean_client_accuracy": max(r["mean_client_accuracy"] for r in evaluated),
        "final_mean_client_accuracy": last["mean_client_accuracy"],
        "final_std_client_accuracy": last["std_client_accuracy"],
        "mean_seconds_per_round": float(np.mean(seconds)) if seconds else math.nan,
        "rounds": last["round"],
    }


def summarize(histories: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]],
              algorithms: Sequence[str], seeds: Sequence[int]) -> dict[str, Any]:
    """``{algorithm: {metric: mean over seeds, metric_std: std, "seeds": {seed: per-run}}}``."""
    out: dict[str, Any] = {}
    for alg in algorithms:
        per_seed = {seed: run_metrics(histories[(alg, seed)]) for seed in seeds}
        entry: dict[str, Any] = {}
        for key in RUN_METRICS:
            values = np.array([m[key] for m in per_seed.values()], dtype=float)
            entry[key] = float(values.mean())
            entry[f"{key}_std"] = float(values.std())
        entry["num_seeds"] = len(seeds)
        entry["seeds"] = {str(s): m for s, m in per_seed.items()}
        out[alg] = entry
    return out


def format_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of the summary (accuracies in %)."""
    multi = any(v["num_seeds"] > 1 for v in summary.values())

    def pct(entry: Mapping[str, Any], key: str) -> str:
        text = f"{100 * entry[key]:.2f}"
        return text + (f" ± {100 * entry[key + '_std']:.2f}" if multi else "")

    header = ["algorithm", "best acc %", "final acc %", "best mean-client acc %", "s/round"]
    rows = [[alg, pct(e, "best_accuracy"), pct(e, "final_accuracy"), pct(e, "best_mean_client_accuracy"),
             f"{e['mean_seconds_per_round']:.3f}"] for alg, e in summary.items()]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])

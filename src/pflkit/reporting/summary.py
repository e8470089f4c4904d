"""Run summaries: per-run metrics from the round history, their mean/std over seeds, a table.

Definitions (see docs/explanations/metrics.md):
  accuracy              pooled over the evaluated clients' test samples: sum correct / sum samples
  mean_client_accuracy  unweighted mean over evaluated clients of correct_i / n_i
  best_*                maximum over evaluated rounds (round 0 = initial model included)
  final_*               value at the last round T
  unseen_accuracy       pooled over the clients that never trained, scored as newcomers
  mean_seconds_per_round  mean wall-clock of training rounds 1..T (local init incl. ALA,
                        evaluation, training, aggregation; not checkpoint I/O)
  seconds_per_round     every pass a user waits for (the T training rounds and the final
                        evaluation pass, where a one-round run meets ALA's start phase) over T
  init_seconds_per_round  the local initialisation's part of it (ALA), summed over clients
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: Evaluation metrics whose best is the maximum over evaluated rounds.
HIGHER_IS_BETTER = (
    "accuracy",
    "mean_client_accuracy",
    "local_accuracy",
    "global_accuracy",
    "global_client_accuracy",
    "unseen_accuracy",  # the clients that never trained ([run] unseen_clients)
)
#: Training-round metrics whose best is the minimum ([metrics] adaptability).
LOWER_IS_BETTER = ("local_risk", "local_kl")
#: Training-round costs whose mean over rounds the summary keeps (communication, time split).
PER_ROUND_COSTS = (
    "down_floats_per_client",
    "up_floats_per_client",
    "down_bytes",
    "up_bytes",
    "init_seconds",
    "train_seconds",
    "eval_seconds",
    "global_eval_seconds",
    "update_variance",
)  # not a cost: SosicFL Fig. 6's total variance, its mean over rounds
RUN_METRICS = (
    "best_accuracy",
    "final_accuracy",
    "best_mean_client_accuracy",
    "final_mean_client_accuracy",
    "mean_seconds_per_round",
)


def summary_metrics() -> set[str]:
    """The numbers a summary may hold per method (each with its ``_std``): what ``--metric`` may name."""
    return {
        "final_std_client_accuracy",
        "mean_seconds_per_round",
        "seconds_per_round",
        "init_seconds_per_round",
        *(f"{kind}_{key}" for key in (*HIGHER_IS_BETTER, *LOWER_IS_BETTER) for kind in ("best", "final")),
        *(f"mean_{key}" for key in PER_ROUND_COSTS),
    }


def run_metrics(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``best_<m>`` and ``final_<m>`` of every metric the run recorded, and the mean round time."""
    evaluated = [r for r in history if "accuracy" in r]
    if not evaluated:
        raise ValueError("history holds no evaluated round")
    best = max(evaluated, key=lambda r: r["accuracy"])
    seconds = [r["seconds"] for r in history if "seconds" in r]
    last = evaluated[-1]
    out: dict[str, Any] = {
        "best_round": best["round"],
        "rounds": last["round"],
        "final_std_client_accuracy": last["std_client_accuracy"],
        "mean_seconds_per_round": float(np.mean(seconds)) if seconds else math.nan,
    }
    for key in HIGHER_IS_BETTER:
        values = [r[key] for r in evaluated if key in r]
        if values:
            out[f"best_{key}"], out[f"final_{key}"] = max(values), values[-1]
    for key in LOWER_IS_BETTER:
        values = [r[key] for r in history if key in r]
        if values:
            out[f"best_{key}"], out[f"final_{key}"] = min(values), values[-1]
    final = history[-1] if history else {}
    if seconds and "final_pass_seconds" in final and last["round"] > 0:
        rounds = last["round"]
        out["seconds_per_round"] = (sum(seconds) + final["final_pass_seconds"]) / rounds
        init = sum(r.get("init_seconds", 0.0) for r in history) + final.get("final_pass_init_seconds", 0.0)
        out["init_seconds_per_round"] = init / rounds
    for key in PER_ROUND_COSTS:
        values = [r[key] for r in history if key in r]
        if values:
            out[f"mean_{key}"] = float(np.mean(values))
    return out


def summarize(
    histories: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]], algorithms: Sequence[str], seeds: Sequence[int]
) -> dict[str, Any]:
    """``{algorithm: {metric: mean over seeds, metric_std: std, "seeds": {seed: per-run}}}`` for
    every metric all of its seeds recorded."""
    out: dict[str, Any] = {}
    for alg in algorithms:
        per_seed = {seed: run_metrics(histories[(alg, seed)]) for seed in seeds}
        keys = [
            k
            for k in per_seed[seeds[0]]
            if k not in ("best_round", "rounds") and all(k in m for m in per_seed.values())
        ]
        entry: dict[str, Any] = {}
        for key in keys:
            values = np.array([m[key] for m in per_seed.values()], dtype=float)
            entry[key] = float(values.mean())
            entry[f"{key}_std"] = float(values.std())
        entry["num_seeds"] = len(seeds)
        entry["seeds"] = {str(s): m for s, m in per_seed.items()}
        out[alg] = entry
    return out


ACCURACY_TIE = 1e-9
"""Accuracies (fractions) closer than this are equal: summation noise, not a sample."""


def first_round_reaching(history: Sequence[Mapping[str, Any]], metric: str, target: float) -> int | None:
    """TTA(a) = min{t : acc(t) >= a} on the evaluation grid; None if never reached.

    Equal accuracies count as reached: a pooled accuracy summed over clients in another order can
    differ in its last bits (0.9866000000000001 against ...03), far below one test sample."""
    return next((r["round"] for r in history if metric in r and r[metric] >= target - ACCURACY_TIE), None)


def time_to_accuracy(
    histories: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]],
    bases: Mapping[str, str],
    seeds: Sequence[int],
    metrics: Sequence[str] = ("global_accuracy", "local_accuracy"),
) -> dict[str, dict[str, Any]]:
    """Time-to-accuracy of each method against its base method of the same run (SosicFL paper,
    Section 4.1): the target is the base's best value of the metric, TTA_base the round where the
    base first reaches it, and the improvement TTA_base / TTA_method ("x1.7"), per seed and averaged
    over the seeds where the method reached it; "not reached" where it never did."""
    out: dict[str, dict[str, Any]] = {}
    for method, base in bases.items():
        for metric in metrics:
            per_seed: dict[str, Any] = {}
            for seed in seeds:
                h, b = histories.get((method, seed)), histories.get((base, seed))
                if not h or not b or not any(metric in r for r in b) or not any(metric in r for r in h):
                    continue
                target = max(r[metric] for r in b if metric in r)
                base_round = first_round_reaching(b, metric, target)
                own = first_round_reaching(h, metric, target)
                per_seed[str(seed)] = {
                    "target": target,
                    "base_round": base_round,
                    "round": own,
                    "improvement": (base_round / own) if own and base_round else None,
                }
            if not per_seed:
                continue
            reached = [v["improvement"] for v in per_seed.values() if v["improvement"] is not None]
            out.setdefault(method, {})[f"tta_{metric}_vs_{base}"] = {
                "improvement": float(np.mean(reached)) if reached else "not reached",
                "reached_seeds": len(reached),
                "seeds": per_seed,
            }
    return out


def round_seconds(entry: Mapping[str, Any]) -> float:
    """Seconds per round with every pass counted (``seconds_per_round``); runs recorded before the
    final pass was timed give their training rounds' mean."""
    return float(entry.get("seconds_per_round", entry.get("mean_seconds_per_round", math.nan)))


def format_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of the summary (accuracies in %); global-model and local-test columns
    appear when a run recorded them."""
    multi = any(v["num_seeds"] > 1 for v in summary.values())

    def pct(entry: Mapping[str, Any], key: str) -> str:
        if key not in entry:
            return "-"
        text = f"{100 * entry[key]:.2f}"
        return text + (f" ± {100 * entry[key + '_std']:.2f}" if multi else "")

    columns = [
        ("best acc %", "best_accuracy"),
        ("final acc %", "final_accuracy"),
        ("best mean-client acc %", "best_mean_client_accuracy"),
    ]
    optional = [
        ("best local acc %", "best_local_accuracy"),
        ("best global acc %", "best_global_accuracy"),
        ("best global client-dist acc %", "best_global_client_accuracy"),
        ("best unseen acc %", "best_unseen_accuracy"),
        ("final unseen acc %", "final_unseen_accuracy"),
    ]
    columns += [c for c in optional if any(c[1] in e for e in summary.values())]
    header = ["algorithm", *(name for name, _ in columns), "s/round"]
    rows = [[alg, *(pct(e, key) for _, key in columns), f"{round_seconds(e):.3f}"] for alg, e in summary.items()]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])

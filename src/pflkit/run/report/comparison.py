"""Our numbers beside the papers' (``reporting.paper``): the metrics, cost and time-to-accuracy
tables of a run, the swept metric of a sweep, and over one setting's methods the agreement of
ranks and gaps and what ALA adds. Each returns a table ``(caption, header, rows)``."""

from __future__ import annotations

import math
from typing import Any

import scipy.stats

from ...reporting.summary import round_seconds
from .render import pct

Table = tuple[str, list[str], list[list[str]]]


def metrics_table(summary: dict[str, Any], cell: dict[str, Any], multi: bool) -> Table:
    """Each method's metrics that the paper's table holds, ours (in %) beside the paper's."""
    prow = []
    for method, entry in summary.items():
        published = cell["values"].get(method)
        if published is None:
            continue
        for metric, value in zip(cell["metrics"], published):
            ours = entry.get(metric)
            diff = "-" if ours is None else f"{100 * ours - value:+.2f}"
            prow.append([method, metric, pct(entry, metric, multi), f"{value:.2f}", diff])
    return (f"beside the paper: {cell['source']}", ["method", "metric", "pflkit", "paper", "pflkit − paper"], prow)


def tta_table(summary: dict[str, Any], published: dict[str, Any]) -> Table | None:
    """Time to accuracy (SosicFL paper, Section 4.1) of the methods that recorded it, beside the
    paper's (its Table 5: ``published`` per method, global then local); None where none recorded
    it."""
    tta = []
    for m, e in summary.items():
        for key, v in e.items():
            if not key.startswith("tta_"):
                continue
            ours = v["improvement"] if isinstance(v["improvement"], str) else f"x{v['improvement']:.2f}"
            paper = published.get(m)
            side = None if paper is None else paper[0 if key.startswith("tta_global") else 1]
            tta.append(
                [
                    m,
                    key[len("tta_") :],
                    ours,
                    f"{v['reached_seeds']}/{len(v['seeds'])}",
                    "-" if side is None else f"x{side:.1f}",
                ]
            )
    if not tta:
        return None
    return (
        "time to accuracy (SosicFL paper, Section 4.1; paper: its Table 5)",
        ["method", "metric vs base", "improvement", "seeds reaching", "paper"],
        tta,
    )


def cost_table(summary: dict[str, Any], cell: dict[str, Any]) -> Table:
    """Minutes per round and values sent per client and round in units of Σ (FedAvg's download,
    which is the whole model), beside the paper's cost table."""
    sigma = summary.get("fedavg", {}).get("mean_down_floats_per_client")
    rows = []
    for method, entry in summary.items():
        floats = entry.get("mean_down_floats_per_client", math.nan) + entry.get("mean_up_floats_per_client", math.nan)
        units = f"{floats / sigma:.2f}Σ" if sigma and not math.isnan(floats) else f"{floats:,.0f} values"
        minutes, formula = cell["cost"].get(method, (math.nan, "-"))
        rows.append(
            [
                method,
                f"{round_seconds(entry) / 60:.2f}",
                "-" if math.isnan(minutes) else f"{minutes:.2f}",
                units,
                formula,
            ]
        )
    return (
        f"cost beside the paper: {cell['source']}",
        ["method", "min/round", "paper min/iter", "sent per client and round", "paper"],
        rows,
    )


def sweep_paper_table(record: dict[str, Any], cell: dict[str, Any]) -> Table:
    """Each sweep cell's value of the paper's swept metric beside the paper's number for the same
    setting (cells whose swept value the paper did not run show "-")."""
    sweep = cell["sweep"]
    key, metric = sweep["key"], sweep["metric"]
    if key not in [a["key"] for a in record["axes"]]:
        raise ValueError(
            f"paper_table {cell['source']!r} sweeps {key}, which this sweep does not "
            f"(its axes: {', '.join(a['key'] for a in record['axes'])})"
        )
    others = [a["key"] for a in record["axes"] if a["key"] != key]
    params = sweep.get("params", {})
    rows = []
    for c in record["cells"]:
        entry = c.get("summary", {}).get(sweep["algorithm"])
        if entry is None:
            continue
        value = c["values"][key]
        paper = next((v for k, v in sweep["values"].items() if k == value), None)
        multi = entry.get("num_seeds", 1) > 1
        ours = entry.get(metric)
        diff = "-" if ours is None or paper is None else f"{100 * ours - paper:+.2f}"
        row = [
            str(value),
            *(str(c["values"][k]) for k in others),
            pct(entry, metric, multi),
            "-" if paper is None else f"{paper:.2f}",
            diff,
        ]
        if params:  # the "Param." row: ALA's learnable weights, ours and the paper's
            theirs = params.get(value)
            row += [
                f"{entry['ala_weights']:,}" if "ala_weights" in entry else "-",
                "-" if theirs is None else f"{theirs:,}",
            ]
        rows.append(row)
    header = [key, *others, f"pflkit {metric}", "paper", "pflkit − paper"]
    if params:
        header += ["ALA weights", "paper ALA weights"]
    return f"beside the paper: {cell['source']}", header, rows


def ranking_table(ours: dict[str, float], paper: dict[str, float], base: str = "fedavg") -> Table | None:
    """How our ranking and gaps agree with the paper's over the methods both have (best
    accuracy, ours a fraction, the paper's in %): a table of ranks and gaps to ``base`` whose
    caption gives Kendall's tau and how many methods are on the same side of ``base`` in both.
    None where fewer than two methods have both numbers."""
    common = [m for m in ours if m in paper]
    if len(common) < 2:
        return None
    mine = {m: 100 * ours[m] for m in common}
    rank_ours = {m: i + 1 for i, m in enumerate(sorted(common, key=lambda m: -mine[m]))}
    rank_paper = {m: i + 1 for i, m in enumerate(sorted(common, key=lambda m: -paper[m]))}
    tau = scipy.stats.kendalltau([mine[m] for m in common], [paper[m] for m in common]).statistic
    has_base = base in common
    text = (
        f"ranks and gaps (points of best accuracy) beside the paper: over the {len(common)} methods that both "
        "have, Kendall's tau between our best accuracies and the paper's is "
        + ("undefined (all tied on one side)." if math.isnan(tau) else f"{tau:.2f} (1: the same order, 0: unrelated).")
    )
    if has_base:
        others = [m for m in common if m != base]
        same = [m for m in others if (mine[m] - mine[base]) * (paper[m] - paper[base]) > 0]
        apart = [m for m in others if m not in same]
        text += f" {len(same)} of {len(others)} methods are on the same side of {base} in both" + (
            f" (on the other side in one of them: {', '.join(apart)})." if apart else "."
        )
    header = ["method", "pflkit rank", "paper rank"]
    if has_base:
        header += [f"pflkit − {base}", f"paper − {base}"]
    rows = []
    for m in sorted(common, key=lambda m: rank_ours[m]):
        row = [m, str(rank_ours[m]), str(rank_paper[m])]
        if has_base:
            row += [f"{mine[m] - mine[base]:+.2f}", f"{paper[m] - paper[base]:+.2f}"]
        rows.append(row)
    return text, header, rows


def _with_ala(method: str, numbers: dict[str, float]) -> str | None:
    """The name under which ``numbers`` hold ``method`` + ALA (FedAvg + ALA is FedALA)."""
    names = [f"{method}+ala"] + (["fedala"] if method == "fedavg" else [])
    return next((n for n in names if n in numbers), None)


def ala_gain_table(ours: dict[str, float], paper: dict[str, float]) -> Table | None:
    """What ALA adds to each method X that ran both as X and as X + ALA (``X+ala``; for FedAvg,
    FedALA), in points of best accuracy, with the paper's gain where its table has both; None
    where no pair ran."""
    rows = []
    for m in ours:
        with_ala = _with_ala(m, ours) if not m.endswith("+ala") else None
        if with_ala is None:
            continue
        gain = 100 * (ours[with_ala] - ours[m])
        theirs = _with_ala(m, paper) if m in paper else None
        rows.append(
            [
                m,
                with_ala,
                f"{100 * ours[m]:.2f}",
                f"{100 * ours[with_ala]:.2f}",
                f"{gain:+.2f}",
                "-" if theirs is None else f"{paper[theirs] - paper[m]:+.2f}",
            ]
        )
    if not rows:
        return None
    return (
        "X + ALA: what the ALA module adds to each method run both ways",
        ["X", "X + ALA", "X best acc", "X + ALA best acc", "gain", "paper gain"],
        rows,
    )

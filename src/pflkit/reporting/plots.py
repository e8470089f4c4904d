"""Figures written into every results folder (matplotlib, no display needed)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from .styles import integer_ticks, method_style


def _save(fig: Any, path: Path, title: str = "") -> None:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_accuracy(
    histories: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]],
    path: Path,
    title: str = "",
    *,
    metric: str = "accuracy",
    label: str = "test accuracy (%)",
    scale: float = 100.0,
) -> None:
    """``metric`` (times ``scale``: accuracies in %) per round that records it, one line per
    algorithm (mean ± std band over seeds); algorithms that never record it are left out."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for alg in dict.fromkeys(a for a, _ in histories):
        runs = [[(r["round"], r[metric]) for r in h if metric in r] for (a, _), h in histories.items() if a == alg]
        length = min(len(run) for run in runs)
        if not length:
            continue
        rounds = np.array([p[0] for p in runs[0][:length]])
        acc = scale * np.array([[p[1] for p in run[:length]] for run in runs])
        mean = acc.mean(0)
        (line,) = ax.plot(rounds, mean, label=alg, **method_style(alg))
        if len(runs) > 1:
            ax.fill_between(rounds, mean - acc.std(0), mean + acc.std(0), color=line.get_color(), alpha=0.2)
    ax.set_xlabel("round")
    integer_ticks(ax.xaxis)
    ax.set_ylabel(label)
    ax.set_title(title or f"{metric} per round")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    _save(fig, path)


def plot_partition(counts: np.ndarray, path: Path, title: str = "", domains: Sequence[str] = ()) -> None:
    """Clients x classes bubble chart; bubble area ~ sample count (FedALA Figs. 6-9); ``domains``:
    each client's domain (feature shift), written above its column. Above 100 clients, a heat map
    of fixed size instead, without domains (a bubble per client would need a canvas of hundreds
    of megabytes at 10,000 clients)."""
    counts = np.asarray(counts)
    title = textwrap.fill(title, 70)  # a long title (method, sizes, IID share) wraps instead of being cut
    if counts.shape[0] > 100:
        fig, ax = plt.subplots(figsize=(12, max(3.5, 0.35 * counts.shape[1])))
        image = ax.imshow(counts.T, aspect="auto", interpolation="nearest", cmap="Reds", origin="lower")
        fig.colorbar(image, ax=ax, label="samples")
        ax.set_xlabel("client id")
        ax.set_ylabel("class label")
        ax.set_title(title or "data distribution")
        _save(fig, path)
        return
    clients, classes = np.nonzero(counts)
    sizes = counts[clients, classes]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * counts.shape[0]), max(3.5, 0.35 * counts.shape[1])))
    ax.scatter(clients, classes, s=600 * sizes / max(sizes.max(), 1), alpha=0.6, color="tab:red")
    ax.set_xlabel("client id")
    ax.set_ylabel("class label")
    ax.set_xticks(range(counts.shape[0]))
    ax.set_yticks(range(counts.shape[1]))
    ax.set_xlim(-1, counts.shape[0])
    ax.set_ylim(-1, counts.shape[1])
    ax.set_title(title or "data distribution")
    ax.grid(alpha=0.3)
    if len(domains) == counts.shape[0]:
        top = ax.secondary_xaxis("top")
        top.set_xticks(range(counts.shape[0]), list(domains), rotation=90, fontsize=7)
        top.set_xlabel("client domain")
    _save(fig, path)


def _simplex_xy(points: np.ndarray) -> np.ndarray:
    """2-d coordinates of simplex points: the 1-simplex as a segment, the 2-simplex as an
    equilateral triangle with corners e1 (0, 0), e2 (1, 0), e3 (1/2, sqrt(3)/2)."""
    points = np.asarray(points, dtype=np.float64)
    if points.shape[1] == 2:
        return np.stack([points[:, 1], np.zeros(len(points))], 1)
    return np.stack([points[:, 1] + points[:, 2] / 2, points[:, 2] * np.sqrt(3) / 2], 1)


def _simplex_frame(ax: Any, dims: int) -> None:
    corners = np.eye(dims)
    xy = _simplex_xy(corners)
    ax.plot(*np.vstack([xy, xy[:1]]).T, color="black", lw=1)
    for m, (x, y) in enumerate(xy):
        ax.annotate(f"θ{m + 1}", (x, y), textcoords="offset points", xytext=(0, 6 if y > 0 else -14), ha="center")
    ax.set_aspect("equal")
    ax.axis("off")


def plot_simplex_clusters(
    points: np.ndarray,
    assignment: np.ndarray,
    centers: np.ndarray,
    pools: np.ndarray,
    path: Path,
    title: str = "",
    region_points: int = 400,
) -> bool:
    """The clients' LDA points on the simplex coloured by cluster, each cluster's centre (star) and
    a sample of its subregion (light dots) (SosicFL Figs. 1-3). Drawn for 2 or 3 endpoints;
    returns False (and draws nothing) for larger simplices."""
    dims = np.asarray(points).shape[1]
    if dims not in (2, 3):
        return False
    fig, ax = plt.subplots(figsize=(6, 5.4))
    colors = plt.get_cmap("tab10" if len(centers) <= 10 else "tab20")
    for c in range(len(centers)):
        region = _simplex_xy(np.asarray(pools[c])[:region_points])
        ax.scatter(region[:, 0], region[:, 1], s=3, color=colors(c % colors.N), alpha=0.15, linewidths=0)
    xy = _simplex_xy(points)
    for c in range(len(centers)):
        members = np.asarray(assignment) == c
        ax.scatter(
            xy[members, 0],
            xy[members, 1],
            s=28,
            color=colors(c % colors.N),
            edgecolors="black",
            linewidths=0.4,
            label=f"cluster {c} ({int(members.sum())} clients)",
        )
    centre_xy = _simplex_xy(centers)
    ax.scatter(
        centre_xy[:, 0],
        centre_xy[:, 1],
        marker="*",
        s=220,
        color="gold",
        edgecolors="black",
        zorder=5,
        label="cluster centres",
    )
    _simplex_frame(ax, dims)
    ax.set_title(title or "clients on the simplex")
    ax.legend(fontsize=7, loc="upper right", bbox_to_anchor=(1.05, 1.0))
    _save(fig, path)
    return True


def plot_simplex_landscape(
    alphas: np.ndarray,
    accuracy: Mapping[str, np.ndarray],
    centers: Mapping[str, np.ndarray],
    path: Path,
    title: str = "",
    points: Mapping[str, np.ndarray] | None = None,
    labels: Mapping[str, str] | None = None,
) -> bool:
    """Accuracy over simplex points, one panel per entry of ``accuracy`` (SosicFL Fig. 5: the
    global model's panel first, then the clients'); x marks ``centers`` (a client's cluster
    centre, the global model's centroid), a dot ``points`` (the client's own LDA point).
    ``labels`` names each panel's colour bar (default: local test accuracy). Drawn for 2 or 3
    endpoints (returns False otherwise)."""
    dims = np.asarray(alphas).shape[1]
    if dims not in (2, 3) or not accuracy:
        return False
    fig, axes = plt.subplots(1, len(accuracy), figsize=(4.6 * len(accuracy), 4.4), squeeze=False)
    xy = _simplex_xy(alphas)
    for ax, (label, acc) in zip(axes[0], accuracy.items()):
        sc = ax.scatter(*xy.T, c=100 * np.asarray(acc), s=6, cmap="viridis")  # scaled to the panel's range
        if points is not None and label in points:
            ax.scatter(
                *_simplex_xy(np.asarray(points[label])[None]).T,
                marker="o",
                s=70,
                color="red",
                edgecolors="white",
                zorder=5,
                label="its LDA point",
            )
        ax.scatter(
            *_simplex_xy(np.asarray(centers[label])[None]).T,
            marker="x",
            s=110,
            color="black",
            linewidths=2.5,
            zorder=6,
            label="cluster centre" if points and label in points else "centroid",
        )
        _simplex_frame(ax, dims)
        ax.set_title(label, fontsize=9)
        ax.legend(loc="upper right", fontsize=7, framealpha=0.8)
        fig.colorbar(sc, ax=ax, fraction=0.046, label=(labels or {}).get(label, "local test accuracy (%)"))
    _save(fig, path, title)
    return True


def plot_sweep(
    x_key: str, other_keys: Sequence[str], cells: Sequence[Mapping[str, Any]], metric: str, path: Path
) -> None:
    """``metric`` of each sweep cell against the values of ``x_key``: one line per algorithm and
    combination of the other swept keys, error bars = std over seeds (FedALA Tables 1, 6 as plots)."""
    xs = list(dict.fromkeys(repr(c["values"][x_key]) for c in cells))
    raw = {repr(c["values"][x_key]): c["values"][x_key] for c in cells}
    numeric = all(isinstance(raw[x], (int, float)) and not isinstance(raw[x], bool) for x in xs)
    position = {x: (raw[x] if numeric else i) for i, x in enumerate(xs)}
    scale = 100 if "accuracy" in metric else 1
    lines: dict[str, list[tuple[float, float, float]]] = {}
    algorithms: dict[str, tuple[str, str]] = {}  # label -> (algorithm, the other keys' values)
    combos: list[str] = []
    for cell in cells:
        rest = ", ".join(f"{k}={cell['values'][k]}" for k in other_keys)
        combos += [rest] if rest not in combos else []
        for algorithm, entry in cell["summary"].items():
            if metric not in entry:
                continue
            label = algorithm + (f" ({rest})" if rest else "")
            algorithms[label] = (algorithm, rest)
            lines.setdefault(label, []).append(
                (position[repr(cell["values"][x_key])], scale * entry[metric], scale * entry.get(metric + "_std", 0.0))
            )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = "osD^v<>ph*"
    for label, points in lines.items():
        points.sort()
        x, y, err = (np.array(v) for v in zip(*points))
        algorithm, rest = algorithms[label]
        style = method_style(algorithm)
        marker = markers[combos.index(rest) % len(markers)]
        ax.errorbar(x, y, yerr=err, marker=marker, capsize=3, label=label, **style)
    ax.set_xticks([position[x] for x in xs])
    ax.set_xticklabels([str(raw[x]) for x in xs])
    ax.set_xlabel(x_key)
    ax.set_ylabel(metric + (" (%)" if scale == 100 else ""))
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_ala(
    histories: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, title: str = "", client: int | None = None
) -> bool:
    """ALA's learned weights over rounds (client means of each unit's W mean, share at 0 and at 1)
    and its weight-learning loss, one column per method, and with ``client`` that client's loss per
    weight-learning epoch in its start phase (paper Fig. 3); False when no run recorded them."""
    runs = {alg: h for alg, h in histories.items() if any(k.startswith("ala_w_mean.") for r in h for k in r)}
    if not runs:
        return False
    rows_of_panels = 3 if client is not None else 2
    fig, axes = plt.subplots(rows_of_panels, len(runs), figsize=(6 * len(runs), 3.5 * rows_of_panels), squeeze=False)
    for col, (alg, history) in enumerate(runs.items()):
        rows = [r for r in history if "train_round" in r]
        units = sorted({k.split(".", 1)[1] for r in rows for k in r if k.startswith("ala_w_mean.")})
        ax = axes[0][col]
        for unit in units:
            x = [r["train_round"] for r in rows if f"ala_w_mean.{unit}" in r]
            for stat, style, name in (
                ("mean", "-", "mean W"),
                ("zero", ":", "share of W at 0"),
                ("one", "--", "share of W at 1"),
            ):
                ax.plot(
                    x,
                    [r[f"ala_w_{stat}.{unit}"] for r in rows if f"ala_w_mean.{unit}" in r],
                    style,
                    label=f"{unit}: {name}",
                )
        ax.set_title(f"{alg}: learned ALA weights (client means)")
        ax.set_xlabel("round")
        integer_ticks(ax.xaxis)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][col]
        losses = [(r["train_round"], r["ala_loss"]) for r in rows if "ala_loss" in r]
        if losses:
            ax.plot(*zip(*losses), marker=".", label="ALA loss (last weight-learning step)")
        epochs = [(r["train_round"], r["ala_epochs"]) for r in rows if "ala_epochs" in r]
        if epochs:
            twin = ax.twinx()
            twin.plot(*zip(*epochs), color="tab:gray", alpha=0.6, label="ALA epochs (mean)")
            twin.set_ylabel("epochs")
        ax.set_xlabel("round")
        integer_ticks(ax.xaxis)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
        if client is not None:
            ax = axes[2][col]
            start = next(
                (
                    (r["train_round"], r["ala_start_losses"][str(client)])
                    for r in rows
                    if str(client) in r.get("ala_start_losses", {})
                ),
                None,
            )
            if start is not None:
                ax.plot(range(1, len(start[1]) + 1), start[1], marker=".")
                ax.set_title(f"client {client}: ALA start phase (round {start[0]})", fontsize=9)
            else:
                ax.set_title(f"client {client}: no start phase recorded", fontsize=9)
            ax.set_xlabel("weight-learning epoch")
            integer_ticks(ax.xaxis)
            ax.set_ylabel("loss (last step of the epoch)")
            ax.grid(alpha=0.3)
    _save(fig, path, title)
    return True


def plot_trajectory(
    paths: Mapping[str, np.ndarray],
    rounds: Mapping[str, Sequence[int]],
    a_axis: np.ndarray,
    b_axis: np.ndarray,
    surface: np.ndarray,
    explained: Sequence[float],
    path: Path,
    title: str = "",
) -> None:
    """Model paths on a PCA plane over a loss surface (FedALA Fig. 4): contours of ``surface``
    [len(b_axis), len(a_axis)], one path per algorithm, its first and last round marked."""
    fig, ax = plt.subplots(figsize=(7, 6))
    contour = ax.contourf(a_axis, b_axis, surface, levels=20, cmap="Blues_r", alpha=0.8)
    fig.colorbar(contour, ax=ax, label="training loss of the client")
    for algorithm, points in paths.items():
        (line,) = ax.plot(points[:, 0], points[:, 1], marker=".", label=algorithm, **method_style(algorithm))
        ax.annotate(f"r{rounds[algorithm][0]}", points[0], color=line.get_color(), fontsize=8)
        ax.annotate(f"r{rounds[algorithm][-1]}", points[-1], color=line.get_color(), fontsize=8)
    ax.set_xlabel(f"PC 1 ({100 * explained[0]:.0f} % of variance)")
    ax.set_ylabel(f"PC 2 ({100 * explained[1]:.0f} % of variance)")
    ax.legend()
    _save(fig, path, title)

"""Figures written into every results folder (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_accuracy(histories: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]], path: Path,
                  title: str = "", *, metric: str = "accuracy", label: str = "test accuracy (%)") -> None:
    """``metric`` per evaluated round, one line per algorithm (mean ± std band over seeds);
    algorithms that never record it are left out."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for alg in dict.fromkeys(a for a, _ in histories):
        runs = [[(r["round"], r[metric]) for r in h if metric in r]
                for (a, _), h in histories.items() if a == alg]
        length = min(len(run) for run in runs)
        if not length:
            continue
        rounds = np.array([p[0] for p in runs[0][:length]])
        acc = 100 * np.array([[p[1] for p in run[:length]] for run in runs])
        mean = acc.mean(0)
        (line,) = ax.plot(rounds, mean, label=alg)
        if len(runs) > 1:
            ax.fill_between(rounds, mean - acc.std(0), mean + acc.std(0), color=line.get_color(), alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel(label)
    ax.set_title(title or f"{metric} per round")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_partition(counts: np.ndarray, path: Path, title: str = "") -> None:
    """Clients x classes bubble chart; bubble area ~ sample count (FedALA Figs. 6-9)."""
    counts = np.asarray(counts)
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

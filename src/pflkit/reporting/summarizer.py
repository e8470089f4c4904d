"""What a results folder shows of its run: figures while it runs, the summary and the accuracy
curves when it ends. The experiment loop (``federation.run_all``) calls it; it knows nothing of
results folders or engines, only numbers and paths."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .plots import plot_accuracy, plot_partition, plot_simplex_clusters
from .summary import summarize, time_to_accuracy


class RunSummarizer:
    """The figures and summary of one run (the simulator's and Flower's alike)."""

    def partition(self, counts: np.ndarray, path: Path, title: str, domains: Sequence[str] = ()) -> None:
        """The clients' label counts and, under feature shift, their domains (drawn once: a resumed
        run keeps the first picture)."""
        if not path.exists():
            plot_partition(counts, path, title, domains)

    def server_state(self, name: str, seed: int, server: Mapping[str, Any], plots: Path) -> None:
        """Figures of a finished run's server state: SosicFL's clients on the simplex (LDA points,
        clusters and their subregions) where the state holds them."""
        if "simplex" in server:
            simplex = server["simplex"]
            points, assignment, centers, pools = (
                np.asarray(simplex[k].cpu()) for k in ("points", "assignment", "centers", "pools")
            )
            plot_simplex_clusters(
                points,
                assignment,
                centers,
                pools,
                plots / f"simplex-{name}.png",
                f"{name}: clients' LDA points and cluster subregions (seed {seed})",
            )

    def finish(
        self,
        histories: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]],
        algorithms: Sequence[str],
        seeds: Sequence[int],
        tta_bases: Mapping[str, str],
        plots: Path,
        title: str,
        official: bool,
    ) -> dict[str, Any]:
        """The summary (mean ± std over seeds, time to accuracy against each method's base) and the
        accuracy curves (with ``official``: also the global and local models' curves)."""
        summary = summarize(histories, algorithms, seeds)
        for method, entries in time_to_accuracy(histories, tta_bases, seeds).items():
            summary[method].update(entries)
        plot_accuracy(histories, plots / "accuracy.png", title)
        if any("update_variance" in r for h in histories.values() for r in h):  # SosicFL Fig. 6
            plot_accuracy(
                histories,
                plots / "total_variance.png",
                f"{title}: total variance of the head's updates",
                metric="update_variance",
                label="total variance of the last layer's updates",
                scale=1.0,
            )
        if official:
            plot_accuracy(
                histories,
                plots / "global_accuracy.png",
                f"{title}: global model",
                metric="global_accuracy",
                label="global test accuracy (%)",
            )
            plot_accuracy(
                histories,
                plots / "local_accuracy.png",
                f"{title}: local models",
                metric="local_accuracy",
                label="local test accuracy (%)",
            )
        return summary

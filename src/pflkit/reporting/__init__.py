"""Metrics summaries, tables and figures from saved runs."""

from .plots import plot_accuracy, plot_ala, plot_partition, plot_simplex_clusters, plot_simplex_landscape, plot_sweep
from .summarizer import RunSummarizer
from .summary import RUN_METRICS, format_table, run_metrics, summarize, time_to_accuracy

__all__ = [
    "plot_accuracy",
    "plot_ala",
    "plot_partition",
    "plot_simplex_clusters",
    "plot_simplex_landscape",
    "plot_sweep",
    "RunSummarizer",
    "RUN_METRICS",
    "format_table",
    "run_metrics",
    "summarize",
    "time_to_accuracy",
]

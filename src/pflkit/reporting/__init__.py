"""Metrics summaries, tables and figures from saved runs."""

from .plots import plot_accuracy, plot_partition
from .summary import RUN_METRICS, format_table, run_metrics, summarize

__all__ = ["plot_accuracy", "plot_partition", "RUN_METRICS", "format_table", "run_metrics", "summarize"]

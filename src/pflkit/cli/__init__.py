"""The ``pflkit`` command line: the group (``app``) and its commands, one module per family."""

from . import benchmarks, experiments, leaderboard, plots, records, sweeps  # noqa: F401  (each adds its commands)
from .app import main

__all__ = ["main"]

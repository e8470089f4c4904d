"""The ``pflkit`` command line: the group (``app``) and its commands, one module per family."""

from . import benchmarks, experiments, leaderboard, plots, sweeps  # noqa: F401  (each adds its commands to the group)
from .app import main

__all__ = ["main"]

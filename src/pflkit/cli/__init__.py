"""The ``pflkit`` command line: the group (``app``) and its commands, one module per family."""

from . import benchmarks, experiments, plots, records, sweeps  # noqa: F401  (each module adds its commands to the group)
from .app import main

__all__ = ["main"]

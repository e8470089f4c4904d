"""One sweep cell, run in this process: what ``run.sweep`` runs locally and what a Ray worker of
``run.cluster`` runs (both import it from here, neither imports the other for it)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import BaseConfig
from ..federation import ResultsFolder
from ..federation.driver import Callback
from .experiment import run_experiment


def run_cell(config: BaseConfig, folder: Path, callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """One cell in this process (locally or in a Ray worker): ``summary`` or ``error``, with the
    process; ``resumed_from_pid``: the process of an earlier attempt that died while running it
    (this one continues from its checkpoint)."""
    results = ResultsFolder(folder)
    out: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
    try:
        if results.has_config() and results.status().get("status") == "running":
            out["resumed_from_pid"] = results.status().get("pid")
        out["summary"] = run_experiment(
            config,
            folder,
            resume=results.has_config(),
            progress=False,
            echo=lambda s: None,
            callbacks=callbacks,
        )
    except (ValueError, RuntimeError, OSError, FloatingPointError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out

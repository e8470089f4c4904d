"""Helpers of the end-to-end tests: what a results folder recorded, processes to kill, free ports."""

from __future__ import annotations

import json
import socket
from pathlib import Path


def records(folder: Path) -> list[dict]:
    """metrics.jsonl without any field whose name mentions seconds (wall-clock times)."""
    return [
        {k: v for k, v in json.loads(line).items() if "seconds" not in k}
        for line in (folder / "metrics.jsonl").read_text().splitlines()
    ]


def records_without_timings(folder: Path) -> list[dict]:
    """metrics.jsonl without wall-clock fields (those differ between runs by nature): the fields
    ``seconds`` and ``*_seconds``."""
    out = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if k != "seconds" and not k.endswith("_seconds")})
    return out


class InterruptAfter:
    """Callback: raise KeyboardInterrupt once ``algorithm`` has finished training round ``round``."""

    def __init__(self, algorithm: str, round: int) -> None:
        self.algorithm, self.round = algorithm, round

    def on_record(self, state, record) -> None:
        if state.algorithm == self.algorithm and state.rounds_done == self.round and not state.done:
            raise KeyboardInterrupt("simulated interruption")


def assert_resumes_to_the_uninterrupted_records(config, tmp_path: Path, algorithm: str, after: int = 2) -> None:
    """Run ``config`` whole, and again interrupted once ``algorithm`` has trained round ``after`` and
    then resumed: the two folders record the same numbers (timings aside)."""
    import pytest

    from pflkit.run.experiment import resume_experiment, run_experiment

    run_experiment(config, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            config, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter(algorithm, after)]
        )
    resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    assert records_without_timings(tmp_path / "cut") == records_without_timings(tmp_path / "full")


class DivergeAfter:
    """Callback: raise NonFiniteLossError once ``round`` rounds are trained, as a diverging method's
    run does (the run ends ``failed``)."""

    def __init__(self, round: int = 1) -> None:
        self.round = round

    def on_record(self, state, record) -> None:
        from pflkit.functional.training import NonFiniteLossError

        if state.rounds_done == self.round and not state.done:
            raise NonFiniteLossError(f"training loss became nan (algorithm {state.algorithm}, round {self.round + 1})")


#: ``python -c KILL_AFTER <out> <overrides...>``: a run that SIGKILLs itself once fedala has trained round 3
KILL_AFTER = """
import os, signal, sys
from pflkit.config import load_config
from pflkit.run.experiment import run_experiment

class KillAfter:  # SIGKILL this process once fedala has finished training round 3
    def on_record(self, state, record):
        if state.algorithm == "fedala" and state.rounds_done == 3:
            os.kill(os.getpid(), signal.SIGKILL)

run_experiment(load_config(None, sys.argv[2:]), sys.argv[1], progress=False, callbacks=[KillAfter()])
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

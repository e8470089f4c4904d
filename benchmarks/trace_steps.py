"""Trace one client's training steps in the round after a run's last checkpoint: every step's loss
and the L2 norm of every trained tensor (docs/results-intro.md, "FedDBE at lr 0.1"). It shows where
a loss that ends as NaN starts to grow, and which weights grow with it.

    PFLKIT_DATA=../shared/datasets python benchmarks/trace_steps.py RUN --client 6 > trace.jsonl

RUN is a results folder with its checkpoint (a failed run's too), e.g. one cell of a sweep. A copy
of it resumes in a temporary folder until the client's first local training after the checkpoint
ends or fails (with several algorithms in RUN: the first one resumed). The trace covers the
simulator's per-client engines (loop, parallel), not the batched vmap engine.
One JSON line per step: ``step``, ``loss`` (the method's loss function on the batch, before any
closed-form term such as FedProx's proximal one) and ``norms`` (each trained tensor's L2 norm
before the step); then one line with the run's ``error``, if it stopped on one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pflkit.engines import client as client_engine
from pflkit.run.experiment import resume_experiment


class TraceDone(Exception):
    """The traced client's fit has ended: stop the resumed run."""


@contextmanager
def tracing(client_id: int, record: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """While active, every loss evaluation of ``client_id``'s first fit is passed to ``record``; the
    fit's end raises TraceDone."""
    original_fit, original_loss_value = client_engine.SingleClientContext.fit, client_engine.loss_value
    traced = threading.local()  # the parallel engine trains clients on worker threads

    def fit(self: client_engine.SingleClientContext, *args: Any, **kwargs: Any) -> Any:
        if self.client_id != client_id:
            return original_fit(self, *args, **kwargs)
        traced.step = 0
        try:
            original_fit(self, *args, **kwargs)
        finally:
            traced.step = None  # this worker thread's next client is not traced
        raise TraceDone(f"client {client_id}'s fit of round {self.round} ended")

    def loss_value(loss: Any, net: Any, params: Any, batch: Any, aux: Any, carry: Any) -> Any:
        value, updates = original_loss_value(loss, net, params, batch, aux, carry)
        step = getattr(traced, "step", None)
        if step is not None:
            norms = {k: float(v.detach().norm()) for k, v in params.items() if v.requires_grad}
            record({"step": step, "loss": float(value.detach()), "norms": norms})
            traced.step = step + 1
        return value, updates

    client_engine.SingleClientContext.fit = fit  # type: ignore[method-assign]
    client_engine.loss_value = loss_value
    try:
        yield
    finally:
        client_engine.SingleClientContext.fit = original_fit  # type: ignore[method-assign]
        client_engine.loss_value = original_loss_value


def trace_steps(run: Path, client_id: int, record: Callable[[dict[str, Any]], None]) -> str | None:
    """Resume a copy of ``run`` until ``client_id``'s next local training ends; ``record`` gets each
    step. Returns the error the resumed run stopped on (None when the client's fit ended cleanly)."""
    if not list((run / "checkpoints").glob("*.pt")):
        raise FileNotFoundError(f"{run / 'checkpoints'} holds no checkpoint: trace_steps resumes from one")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / run.name
        shutil.copytree(run, copy)
        with tracing(client_id, record):
            try:
                resume_experiment(copy, progress=False, echo=lambda s: None)
            except TraceDone:
                return None
            except Exception as exc:  # the run's own stop (a NaN loss) is the finding
                return f"{type(exc).__name__}: {exc}"
    raise ValueError(f"client {client_id} trained no more after the checkpoint of {run}: nothing to trace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a results folder with its checkpoints/")
    parser.add_argument("--client", type=int, required=True, help="the client whose steps are traced")
    args = parser.parse_args()
    torch.set_num_threads(1)
    error = trace_steps(args.run, args.client, lambda row: print(json.dumps(row), flush=True))
    if error is not None:
        print(json.dumps({"error": error}))
    sys.exit(0)


if __name__ == "__main__":
    main()

"""Trace one client's training steps in the round after a run's last checkpoint (or in a later
round, ``--round``): every step's loss
and the L2 norm of every trained tensor (docs/papers/fedala.md, "FedDBE at lr 0.1"). It shows where
a loss that ends as NaN starts to grow, and which weights grow with it.

    PFLKIT_DATA=../shared/datasets python benchmarks/trace_steps.py RUN --client 6 > trace.jsonl

RUN is a results folder with its checkpoint (a failed run's too), e.g. one cell of a sweep. A copy
of it resumes in a temporary folder, one client at a time (``engine = "loop"``: the same numbers
as the parallel engine's), until the client's first local training after the checkpoint ends or
fails; with ``--round R``, the rounds before R run untraced and the client's training in round R
is traced. ``--algorithm`` / ``--seed`` pick the run of a folder that holds several (default: the
first one resumed). A fit that brings its own step function (pFedMe, Per-FedAvg, ALA's weight
learning) passes no loss through the trace: it is skipped, and a client whose whole round is
such fits gets an error naming them.

One JSON line per step: ``algorithm``, ``seed``, ``round``, ``stage`` (the fit's, e.g. "local
training"), ``step``, ``loss`` (the method's loss function on the batch, before any closed-form
term such as FedProx's proximal one) and ``norms`` (each trained tensor's L2 norm before the
step; NaN and infinities as the strings "nan", "inf", "-inf"); then one line with the run's
``error``, if it stopped on one.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from pflkit.engines import client as client_engine
from pflkit.federation.results import ResultsFolder
from pflkit.run.experiment import run_experiment

Row = dict[str, Any]


class TraceDone(Exception):
    """The traced fit has ended: stop the resumed run."""


def number(value: float) -> float | str:
    """``value``, or its name where strict JSON has no number for it."""
    return value if math.isfinite(value) else str(value)


@contextmanager
def tracing(
    client_id: int,
    record: Callable[[Row], None],
    algorithm: str | None = None,
    seed: int | None = None,
    at_round: int | None = None,
) -> Iterator[None]:
    """While active, every step of ``client_id``'s first loss-function fit (of ``algorithm`` and
    ``seed`` when given; in round ``at_round`` when given) goes to ``record``; the fit's end raises
    TraceDone, and so does the client's next round when its whole round was step-function fits, or
    a fit after ``at_round`` (with the reason)."""
    original_fit, original_loss_value = client_engine.SingleClientContext.fit, client_engine.loss_value
    traced = SimpleNamespace(row={}, step=None)  # the loop engine: one client's fit at a time
    skipped: dict[str, Any] = {"round": None, "stages": []}

    def fit(self: client_engine.SingleClientContext, *args: Any, **kwargs: Any) -> Any:
        if (
            self.client_id != client_id
            or (algorithm is not None and self.algorithm != algorithm)
            or (seed is not None and self.seed != seed)
        ):
            return original_fit(self, *args, **kwargs)
        stage = kwargs.get("stage", "local training")
        if at_round is not None and self.round < at_round:
            return original_fit(self, *args, **kwargs)
        if at_round is not None and self.round > at_round:
            raise TraceDone(
                f"client {client_id} does not train in round {at_round} (its next training: round {self.round})"
            )
        if skipped["round"] is not None and self.round > skipped["round"]:
            raise TraceDone(
                f"client {client_id}'s round {skipped['round']} trained only with step functions "
                f"({', '.join(skipped['stages'])}), which pass no loss through this trace"
            )
        if kwargs.get("step") is not None:
            skipped["round"] = self.round
            skipped["stages"].append(stage)
            return original_fit(self, *args, **kwargs)
        traced.row = {"algorithm": self.algorithm, "seed": self.seed, "round": self.round, "stage": stage}
        traced.step = 0
        try:
            original_fit(self, *args, **kwargs)
        finally:
            traced.step = None
        raise TraceDone(None)

    def loss_value(loss: Any, net: Any, params: Any, batch: Any, aux: Any, carry: Any) -> Any:
        value, updates = original_loss_value(loss, net, params, batch, aux, carry)
        step = traced.step
        if step is not None:
            norms = {k: number(float(v.detach().norm())) for k, v in params.items() if v.requires_grad}
            record({**traced.row, "step": step, "loss": number(float(value.detach())), "norms": norms})
            traced.step = step + 1
        return value, updates

    client_engine.SingleClientContext.fit = fit  # type: ignore[method-assign]
    client_engine.loss_value = loss_value
    try:
        yield
    finally:
        client_engine.SingleClientContext.fit = original_fit  # type: ignore[method-assign]
        client_engine.loss_value = original_loss_value


def trace_steps(
    run: Path,
    client_id: int,
    record: Callable[[Row], None],
    *,
    algorithm: str | None = None,
    seed: int | None = None,
    at_round: int | None = None,
) -> str | None:
    """Resume a copy of ``run`` until ``client_id``'s next local training ends (its training in
    round ``at_round``, when given); ``record`` gets each step. Returns the error the resumed run
    stopped on (None when the fit ended cleanly); a run that stops before the traced fit (a NaN in
    an earlier round) returns that error with no steps recorded."""
    if not list((run / "checkpoints").glob("*.pt")):
        raise FileNotFoundError(f"{run / 'checkpoints'} holds no checkpoint: trace_steps resumes from one")
    config = ResultsFolder(run).load_config()
    clients = config.client_count()
    if clients is not None and not 0 <= client_id < clients:
        raise ValueError(f"{run} has clients 0-{clients - 1}: there is no client {client_id} to trace")
    if client_id in config.unseen_client_ids():
        raise ValueError(f"client {client_id} of {run} never trains (an unseen client): nothing to trace")
    # one client at a time: the batched engines train no single client's fit
    config = config.model_copy(update={"run": config.run.model_copy(update={"engine": "loop"})})
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / run.name
        shutil.copytree(run, copy)
        with tracing(client_id, record, algorithm, seed, at_round):
            try:
                run_experiment(config, copy, resume=True, progress=False, echo=lambda s: None)
            except TraceDone as done:
                if done.args[0] is not None:
                    raise ValueError(str(done.args[0])) from None
                return None
            except Exception as exc:  # the run's own stop (a NaN loss) is the finding
                return f"{type(exc).__name__}: {exc}"
    raise ValueError(f"client {client_id} trained no more after the checkpoint of {run}: nothing to trace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a results folder with its checkpoints/")
    parser.add_argument("--client", type=int, required=True, help="the client whose steps are traced")
    parser.add_argument("--algorithm", help="the run of the folder to trace (default: the first one resumed)")
    parser.add_argument("--seed", type=int, help="its seed (default: the first one resumed)")
    parser.add_argument("--round", type=int, help="trace the client's training in this round (default: its next)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    def show(row: Row) -> None:
        print(json.dumps(row, allow_nan=False), flush=True)

    error = trace_steps(args.run, args.client, show, algorithm=args.algorithm, seed=args.seed, at_round=args.round)
    if error is not None:
        show({"error": error})


if __name__ == "__main__":
    main()

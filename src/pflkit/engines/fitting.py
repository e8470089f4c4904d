"""The epochs of one ``ctx.fit``, shared by both client contexts.

A context supplies how its clients take one epoch of steps (one client with autograd, K clients
under vmap); :func:`run_epochs` decides which clients run each epoch, checks the losses for
NaN/inf with one message, counts epochs, and stops open-ended fits (``until``). Its totals are
per client ([K]); the context turns them into a :class:`~pflkit.algorithms.context.Fit` of its
``client_shape``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from ..algorithms.context import Fit, PerClient, StopRule
from ..functional import Params
from ..functional.training import CarryLossFn, LossFn, Net, NonFiniteLossError


class JobsAbandoned(Exception):
    """The round's client jobs in flight were abandoned (the run is stopping): their results are
    not wanted, and the run continues from its last checkpoint."""


@dataclass
class FitTotals:
    """Per client: the sum of its step losses, its steps, its last step's loss, its epochs with a
    step, and (open-ended fits) the last step loss of each epoch."""

    loss_sum: Tensor
    count: Tensor
    last: Tensor
    epochs: Tensor
    history: list[list[float]] = field(default_factory=list)

    @classmethod
    def zeros(cls, K: int, device: torch.device) -> FitTotals:
        return cls(
            torch.zeros(K, device=device),
            torch.zeros(K, dtype=torch.long, device=device),
            torch.full((K,), math.nan, device=device),
            torch.zeros(K, dtype=torch.long, device=device),
            [[] for _ in range(K)],
        )

    def fit(self, params: Params, client_shape: tuple[int, ...], open_ended: bool) -> Fit:
        """The result of the fit, each number of shape ``client_shape`` (one client: 0-dim)."""
        shape = lambda t: t.reshape(client_shape)  # noqa: E731
        mean = self.loss_sum.double() / self.count.clamp(min=1)
        history: list[float] | list[list[float]] | None = None
        if open_ended:
            history = self.history if client_shape else self.history[0]
        return Fit(params, shape(mean), shape(self.epochs), shape(self.last), shape(self.count), history)


#: ``run_epoch(epoch, running, totals)``: the running clients (positions, sorted as the context
#: likes) take one epoch of steps, their losses added to ``totals``; returns those that took a step.
EpochRunner = Callable[[int, list[int], FitTotals], list[int]]


def active_clients(active: PerClient | None, K: int) -> list[int]:
    """Positions of the clients a fit trains (``active``: a per-client flag, None: all)."""
    if active is None:
        return list(range(K))
    return torch.nonzero(torch.as_tensor(active).reshape(-1)).flatten().tolist()


def run_epochs(
    client_ids: list[int],
    device: torch.device,
    epochs: int,
    run_epoch: EpochRunner,
    *,
    until: StopRule | None,
    max_epochs: int,
    active: PerClient | None,
    where: Callable[[int], str],
) -> FitTotals:
    """Epoch after epoch (``epochs`` of them, or with ``until`` open-ended up to ``max_epochs``)
    over the active clients; a client leaves once an epoch gives it no step or ``until`` says so."""
    totals = FitTotals.zeros(len(client_ids), device)
    running = active_clients(active, len(client_ids))
    for epoch in range(epochs if until is None else max_epochs):
        if not running:
            break
        ran = run_epoch(epoch, running, totals)
        check_losses(totals.loss_sum, running, where)
        if not ran:
            break
        ran_index = torch.tensor(ran, device=device)
        totals.epochs[ran_index] += 1
        if until is not None:
            for k, value in zip(ran, totals.last[ran_index].tolist()):
                totals.history[k].append(value)
            running = [
                k for k in ran if not (until(totals.history[k], client_ids[k]) or len(totals.history[k]) >= max_epochs)
            ]
        else:
            running = [k for k in running if k in set(ran)]
    return totals


def check_losses(loss_sum: Tensor, clients: list[int], where: Callable[[int], str]) -> None:
    """NonFiniteLossError naming the first client whose summed loss is NaN or infinite."""
    bad = (~torch.isfinite(loss_sum[torch.tensor(clients, device=loss_sum.device)])).nonzero().flatten()
    if len(bad):
        k = clients[int(bad[0])]
        raise NonFiniteLossError(
            f"training loss became {float(loss_sum[k])} ({where(k)}); lower the learning "
            "rate or check the data for NaN/inf values"
        )


def check_cancel(cancel: threading.Event | None, where: str) -> None:
    """Raise JobsAbandoned when the executor abandons the jobs in flight (a stopping run)."""
    if cancel is not None and cancel.is_set():
        raise JobsAbandoned(f"abandoned ({where}): the run is stopping")


def loss_value(
    loss: LossFn | CarryLossFn, net: Net, params: Params, batch: Any, aux: Any, carry: Sequence[str]
) -> tuple[Tensor, Params]:
    """``loss`` on one batch of the fit's data (a Batch, or a tuple of them with PairedBatches) as
    (value, the carried tensors): with ``carry`` the loss returns both, else its value alone."""
    out = loss(net, params, batch, aux)
    if carry:
        return cast(tuple[Tensor, Params], out)  # a CarryLossFn: which kind of loss fit got, only carry says
    return cast(Tensor, out), {}


def check_fit_arguments(loss: Any, step: Any, carry: Any, epoch_end: Any) -> None:
    if (loss is None) == (step is None):
        raise ValueError("fit takes either a loss or a step function")
    if epoch_end is not None and not carry:
        raise ValueError("fit's epoch_end maps the carried tensors: it needs carry=[...]")
    if carry and step is not None:
        raise ValueError("fit's carry needs a loss function (a step function carries its own tensors)")

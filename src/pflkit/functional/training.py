"""Functional local training and evaluation over parameter dictionaries.

Models are used as stateless skeletons through ``torch.func.functional_call``: the parameters
always come from the caller, so one module serves every client and no client state can leak.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from ..models.base import buffer_names
from .params import Params

Batch = tuple[torch.Tensor, torch.Tensor]
GradHook = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


class NonFiniteLossError(FloatingPointError):
    """A training loss became NaN or infinite."""


def forward(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor, start: int = 0,
            stop: int | None = None, *, train: bool = False) -> torch.Tensor:
    """Run units ``start..stop-1`` of a model with ``params`` (all units by default).

    ``params`` holds the parameters and, for models with batch norm, the running statistics
    (``buffer_names(model)``). ``train=True`` is the training-mode forward: batch norm uses the
    batch statistics and updates the running statistics in ``params`` **in place** (pass clones
    you own); ``train=False`` uses them. Models without buffers ignore the flag.

    pflkit models apply their units as pure functions of the parameter dict; other modules go
    through ``torch.func.functional_call`` (in the module mode ``train`` asks for).
    """
    apply_units = getattr(model, "apply_units", None)
    if apply_units is not None:
        return apply_units(params, x, start, stop, train=train)
    if model.training != train:
        model.train(train)
    if start == 0 and stop is None:
        return functional_call(model, dict(params), (x,))
    return functional_call(model, dict(params), (x,), {"start": start, "stop": stop})


def check_finite(loss_sum: torch.Tensor, where: str) -> None:
    if not math.isfinite(float(loss_sum)):
        raise NonFiniteLossError(
            f"training loss became {float(loss_sum)} ({where}); lower the learning rate "
            "or check the data for NaN/inf values")


def sgd(model: nn.Module, params: Mapping[str, torch.Tensor], batches: Iterable[Batch], lr: float, *,
        trainable: Sequence[str] | None = None, prox_anchor: Mapping[str, torch.Tensor] | None = None,
        prox_mu: float = 0.0, where: str = "local training") -> tuple[Params, float]:
    """Plain mini-batch SGD (no momentum, no weight decay) on cross-entropy.

    Optionally adds the proximal gradient ``prox_mu * (w - anchor)`` (FedProx, Ditto). Only
    ``trainable`` names are updated (default: every parameter in ``params``); the others are
    frozen. Buffers (``buffer_names(model)``, batch-norm running statistics) are never trained:
    they are cloned (the caller's tensors are left untouched), updated by the training-mode
    forward passes and returned with the parameters. Returns new parameters (+ buffers) and the
    mean batch loss. Raises NonFiniteLossError when the loss is NaN/inf.
    """
    buffers = [k for k in buffer_names(model) if k in params]
    buffer_set = set(buffers)
    names = [k for k in (params if trainable is None else trainable) if k not in buffer_set]
    trainable_set = set(names)
    stats = {k: params[k].detach().clone() for k in buffers}
    frozen = {k: v.detach() for k, v in params.items() if k not in trainable_set and k not in buffer_set}
    train = {k: params[k].detach().clone().requires_grad_(True) for k in names}
    leaves = [train[k] for k in names]
    anchors = [prox_anchor[k].detach() for k in names] if prox_anchor is not None and prox_mu else None
    loss_sum = torch.zeros((), device=leaves[0].device)
    count = 0
    for x, y in batches:
        loss = F.cross_entropy(forward(model, {**frozen, **stats, **train}, x, train=True), y)
        grads = torch.autograd.grad(loss, leaves)
        with torch.no_grad():
            if anchors is not None:
                grads = [g.add(w - a, alpha=prox_mu) for g, w, a in zip(grads, leaves, anchors)]
            torch._foreach_add_(leaves, grads, alpha=-lr)
            loss_sum += loss.detach()
        count += 1
    check_finite(loss_sum, where)
    out = {**frozen, **stats, **{k: v.detach() for k, v in train.items()}}
    return {k: out[k] for k in params}, float(loss_sum) / max(count, 1)


@torch.no_grad()
def evaluate(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
             batch_size: int = 1000) -> dict[str, float]:
    """Correct predictions, summed cross-entropy and sample count of ``params`` on (x, y)
    (evaluation mode: batch norm uses the running statistics in ``params``)."""
    correct = 0
    loss = 0.0
    for start in range(0, len(y), batch_size):
        logits = forward(model, params, x[start:start + batch_size], train=False)
        target = y[start:start + batch_size]
        correct += int((logits.argmax(1) == target).sum())
        loss += float(F.cross_entropy(logits, target, reduction="sum"))
    return {"correct": correct, "loss_sum": loss, "num_samples": int(len(y))}

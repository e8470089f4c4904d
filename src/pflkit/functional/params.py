"""Operations on parameter dictionaries (``dict[str, Tensor]``, state-dict names)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

Params = dict[str, torch.Tensor]


def clone(params: Mapping[str, torch.Tensor]) -> Params:
    return {k: v.detach().clone() for k, v in params.items()}


def subset(params: Mapping[str, torch.Tensor], names: Iterable[str]) -> Params:
    return {k: params[k] for k in names}


class WeightedSum:
    """Sum_i w_i * model_i / total, folded in one model at a time (streaming aggregation: a round's
    uploads need not all be held). ``total`` is the sum of the weights to come, known up front, so
    that every model is added as ``acc += (w_i / total) * model_i``: the same operations, in the
    same order, as :func:`weighted_average`, hence the same bits. :meth:`result` checks that the
    added weights reach ``total`` up to float rounding: an announced total is often a compensated
    sum (Python 3.12's ``sum`` of floats) that one-by-one addition misses by an ulp or two.

    ``total=None``: the total is not known up front (a uniform mean over however many uploads
    arrive): every model is added as ``acc += w_i * model_i``, ``sum`` holds that plain sum and
    :meth:`result` divides it by the added weights."""

    def __init__(self, total: float | None = None) -> None:
        if total is not None and total <= 0:
            raise ValueError(f"aggregation weights must sum to a positive number, got {total}")
        self.total = None if total is None else float(total)
        self.added = 0.0
        self.sum: Params | None = None

    def add(self, model: Mapping[str, torch.Tensor], weight: float = 1.0) -> None:
        if self.sum is None:
            self.sum = {name: torch.zeros_like(value) for name, value in model.items()}
        alpha = weight if self.total is None else weight / self.total
        for name, acc in self.sum.items():
            acc.add_(model[name], alpha=alpha)
        self.added += float(weight)

    def result(self) -> Params:
        if self.sum is None:
            raise ValueError("cannot average an empty list of models")
        if self.total is None:
            if self.added <= 0:
                raise ValueError(f"aggregation weights must sum to a positive number, got {self.added:g}")
            return {name: value / self.added for name, value in self.sum.items()}
        if not math.isclose(self.added, self.total, rel_tol=1e-9):
            raise ValueError(f"the added weights sum to {self.added:g}, not to the {self.total:g} announced")
        return self.sum


def weighted_average(models: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> Params:
    """Sum_i w_i * model_i / Sum_i w_i over the keys of the first model (FedAvg), folded
    in list order."""
    if not models:
        raise ValueError("cannot average an empty list of models")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"aggregation weights must sum to a positive number, got {list(weights)}")
    average = WeightedSum(total)
    for model, w in zip(models, weights):
        average.add(model, w)
    return average.result()


def equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Exact equality of every shared tensor (used to detect 'no new global model yet')."""
    return all(torch.equal(a[k], b[k]) for k in a if k in b)


def to_device(obj: Any, device: torch.device | str) -> Any:
    """Move every tensor in nested dicts/lists (parameters, client states) to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    return obj


def scale(coefficient: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``coefficient`` ([] or [K]) times ``tensor`` ([...] or [K, ...]), broadcast over its trailing
    dims: one formula for one client and for a leading client dimension."""
    c = torch.as_tensor(coefficient, dtype=tensor.dtype, device=tensor.device)
    return c.reshape(c.shape + (1,) * (tensor.dim() - c.dim())) * tensor


def message_size(obj: Any) -> tuple[int, int]:
    """(values, bytes) of every tensor in a payload or an upload (nested dicts, lists, tuples):
    what travels between server and client (FedALA Table 3's units of Sigma are its values).
    A plain number counts as one 4-byte value (a 0-d tensor as its own size)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel(), obj.numel() * obj.element_size()
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return 1, 4
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        sizes = [message_size(v) for v in obj]
        return sum(s[0] for s in sizes), sum(s[1] for s in sizes)
    return 0, 0

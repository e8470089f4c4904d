"""Operations on parameter dictionaries (``dict[str, Tensor]``, state-dict names)."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

Params = dict[str, torch.Tensor]


def clone(params: Mapping[str, torch.Tensor]) -> Params:
    return {k: v.detach().clone() for k, v in params.items()}


def subset(params: Mapping[str, torch.Tensor], names: Iterable[str]) -> Params:
    return {k: params[k] for k in names}


def weighted_average(models: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> Params:
    """Sum_i w_i * model_i / Sum_i w_i over the keys of the first model (FedAvg, spec §0.2)."""
    if not models:
        raise ValueError("cannot average an empty list of models")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"aggregation weights must sum to a positive number, got {list(weights)}")
    out: Params = {}
    for name in models[0]:
        acc = torch.zeros_like(models[0][name])
        for model, w in zip(models, weights):
            acc.add_(model[name], alpha=w / total)
        out[name] = acc
    return out


def squared_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return sum(((a[k] - b[k]) ** 2).sum() for k in a)  # type: ignore[return-value]


def equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Exact equality of every shared tensor (used to detect 'no new global model yet')."""
    return all(torch.equal(a[k], b[k]) for k in a if k in b)


def to_device(params: Mapping[str, torch.Tensor], device: torch.device | str) -> Params:
    return {k: v.to(device) for k, v in params.items()}

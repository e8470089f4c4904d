"""Stack per-client states/payloads into batched ones ([K, ...]) and split them back."""

from __future__ import annotations

from typing import Any

import torch


def stack(items: list[Any], device: torch.device | str | None = None) -> Any:
    """Stack a list of like-structured values onto ``device`` (None: where they are); one shared
    tensor object is expanded, not copied.

    Client states may keep Python scalars (flags, counts) and small CPU tensors; stacked, they
    meet the batched computation's tensors, so they must land on its device."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        if all(item is first for item in items):
            return first.to(device).unsqueeze(0).expand(len(items), *first.shape)
        return torch.stack([item.to(device) for item in items])
    if isinstance(first, dict):
        keys = list(first)
        if any(list(item) != keys for item in items):
            raise ValueError("cannot stack client states with different keys")
        return {k: stack([item[k] for item in items], device) for k in keys}
    if isinstance(first, list):
        if any(len(item) != len(first) for item in items):
            raise ValueError("cannot stack lists of different lengths")
        return [stack([item[i] for item in items], device) for i in range(len(first))]
    if isinstance(first, bool) or isinstance(first, (int, float)):
        return torch.tensor(items, device=device)
    if first is None and all(item is None for item in items):
        return None
    raise TypeError(f"cannot stack values of type {type(first).__name__}")


def unstack(batched: Any, k: int, template: Any = None) -> Any:
    """Client ``k``'s own copy of a batched value; python scalar types follow ``template``."""
    if isinstance(batched, torch.Tensor):
        if isinstance(template, bool):
            return bool(batched[k])
        if isinstance(template, int):
            return int(batched[k])
        if isinstance(template, float):
            return float(batched[k])
        if batched.dim() == 0:
            return batched.clone()
        return batched[k].clone()
    if isinstance(batched, dict):
        sub = template if isinstance(template, dict) else {}
        return {key: unstack(value, k, sub.get(key)) for key, value in batched.items()}
    if isinstance(batched, list):
        items = template if isinstance(template, list) else [None] * len(batched)
        return [unstack(value, k, t) for value, t in zip(batched, items)]
    return batched

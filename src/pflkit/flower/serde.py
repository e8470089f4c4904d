"""Pack pflkit's nested payloads/states/uploads into Flower records and back.

Tensors go into an ``ArrayRecord`` under '/'-joined paths; the tree shape and every scalar go
into a JSON skeleton in a ``ConfigRecord``, so any structure an algorithm uses travels intact.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

SEP = "/"


def _flatten(obj: Any, path: str, arrays: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        arrays[path] = obj.detach().cpu().contiguous()
        return {"t": path}
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, str) or SEP in key:
                raise ValueError(f"cannot serialise key {key!r} at {path or '/'}")
        return {"d": {k: _flatten(v, f"{path}{SEP}{k}" if path else k, arrays) for k, v in obj.items()}}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    if isinstance(obj, (list, tuple)):
        return {"l": [_flatten(v, f"{path}{SEP}{i}", arrays) for i, v in enumerate(obj)]}
    raise TypeError(f"cannot serialise {type(obj).__name__} at {path or '/'}")


def _inflate(node: dict[str, Any], arrays: dict[str, torch.Tensor], device: torch.device | str) -> Any:
    if "t" in node:
        return arrays[node["t"]].to(device)
    if "d" in node:
        return {k: _inflate(v, arrays, device) for k, v in node["d"].items()}
    if "l" in node:
        return [_inflate(v, arrays, device) for v in node["l"]]
    return node["v"]


def pack(obj: Any) -> tuple[ArrayRecord, str]:
    """(ArrayRecord of every tensor, JSON skeleton of the structure and scalars)."""
    arrays: dict[str, torch.Tensor] = {}
    skeleton = _flatten(obj, "", arrays)
    record = ArrayRecord()
    for key, tensor in arrays.items():
        record[key] = Array(tensor)
    return record, json.dumps(skeleton)


def unpack(record: ArrayRecord, skeleton: str, device: torch.device | str = "cpu") -> Any:
    arrays = {key: torch.from_numpy(array.numpy().copy()) for key, array in record.items()}
    return _inflate(json.loads(skeleton), arrays, device)


def put(content: Any, name: str, obj: Any) -> None:
    """Store ``obj`` in a RecordDict (message content or context.state) under ``name``."""
    arrays, skeleton = pack(obj)
    content[f"{name}.arrays"] = arrays
    content[f"{name}.meta"] = ConfigRecord({"skeleton": skeleton})


def get(content: Any, name: str, device: torch.device | str = "cpu") -> Any:
    """Read back what ``put`` stored; KeyError if absent."""
    return unpack(content[f"{name}.arrays"], str(content[f"{name}.meta"]["skeleton"]), device)


def has(content: Any, name: str) -> bool:
    return f"{name}.meta" in content

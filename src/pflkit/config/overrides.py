"""Dotted ``key=value`` overrides: parsing them, splitting a command line of them, setting them."""

from __future__ import annotations

import tomllib
from typing import Any

from .aliases import SECTIONS, Written, canonical_path
from .errors import ConfigError


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as a TOML value, else the raw string)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words such as dataset=mnist
    return path, value


def split_overrides(text: str) -> list[str]:
    """Split ``"a=1 b=['x', 'y'] c.d=\"s t\""`` into overrides at spaces outside quotes/brackets."""
    items, current, depth, quote = [], "", 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch.isspace() and depth == 0:
            if current:
                items.append(current)
            current = ""
            continue
        current += ch
    if quote or depth:
        raise ConfigError(f"unbalanced quotes or brackets in overrides {text!r}")
    return items + ([current] if current else [])


def merge(base: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``path`` to ``value``; a table set onto a table updates it key by key (``train={lr=0.05}``
    keeps the file's other [train] settings)."""
    node = base
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {part} is not a section")
        node = child
    if isinstance(value, dict) and isinstance(node.get(path[-1]), dict):
        for key, item in value.items():
            merge(node[path[-1]], [key], item)
    else:
        node[path[-1]] = value


def apply_override(data: dict[str, Any], item: str, written: Written) -> None:
    """Set override ``item`` in the sectioned table ``data``, whatever the spelling of its key
    (``lr=0.05`` and ``train.lr=0.05`` replace the same setting), and record the spelling."""
    path, value = parse_override(item)
    target = canonical_path(path, value)
    merge(data, target, value)
    replaced = [tuple(target)] if not isinstance(value, dict) else [(*target, field) for field in value]
    for key in [k for k in written if any(k[: len(r)] == r for r in replaced)]:
        del written[key]
    if len(target) == 2 and target[0] in SECTIONS:
        written[(target[0], target[1])] = ".".join(path)
    elif len(target) == 1 and target[0] in SECTIONS and isinstance(value, dict):
        written.update({(target[0], field): f"{target[0]}.{field}" for field in value})

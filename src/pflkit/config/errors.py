"""Validation errors as one line per problem, naming each key as the user wrote it."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from .aliases import FLAT_KEYS, Written


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key(s)."""


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _known_keys(loc: tuple[Any, ...], schema: type[BaseModel]) -> list[str]:
    """The keys allowed next to the unknown one at ``loc`` (top level, with the flat aliases, or a section)."""
    model: Any = schema
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields) + (list(FLAT_KEYS) if len(loc) == 1 else [])


def _message(err: Mapping[str, Any], schema: type[BaseModel]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        known = _known_keys(tuple(err["loc"]), schema)
        close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
        return "unknown key" + (f" (did you mean {close[0]!r}?)" if close else "")
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"must be {_BOUNDS[kind]} {bound}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    return str(err["msg"]).removeprefix("Value error, ")


def _as_written(loc: tuple[Any, ...], written: Written) -> str:
    """The dotted key of ``loc`` as the user wrote it (``("train", "lr")`` -> ``lr`` for a flat ``lr``)."""
    parts = tuple(str(p) for p in loc)
    for n in range(len(parts), 0, -1):
        if parts[:n] in written:
            return ".".join((written[parts[:n]], *parts[n:]))
    return ".".join(parts)


def format_errors(error: ValidationError, source: str, written: Written | None, schema: type[BaseModel]) -> str:
    """One line per problem, each naming the key as the user wrote it (``written``: see
    :func:`nest`), what it must be and the value given (``schema``: the config model validated)."""
    lines = [f"invalid configuration ({source}):"]
    for err in error.errors():
        if not err["loc"]:  # a rule across keys: its message names them
            lines.append(f"  {_message(err, schema)}")
            continue
        lines.append(
            f"  {_as_written(tuple(err['loc']), written or {})}: {_message(err, schema)} (got {err.get('input')!r})"
        )
    return "\n".join(lines)

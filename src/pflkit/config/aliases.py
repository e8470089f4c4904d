"""The flat keys of earlier configs (``lr = 0.05``, ``partition = "pathological"`` ...): aliases of
settings in the sections, moved into them before validation, with a record of how each key was written
(every message names a key as the user wrote it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationInfo

#: The flat keys users typed before the sections existed, still accepted at the top level (in
#: files, overrides, sweep grids and old results folders): flat key -> (section, field).
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "partition": ("partition", "method"),
    "partition_rng": ("partition", "rng"),
    "partition_seed": ("partition", "seed"),
    **{
        key: ("partition", key)
        for key in (
            "num_clients",
            "alpha",
            "classes_per_client",
            "balanced",
            "min_samples_per_client",
            "balance_cap",
            "train_fraction",
            "num_folds",
            "primary_fraction",
            "test_set",
        )
    },
    **{
        key: ("train", key)
        for key in (
            "batch_size",
            "local_epochs",
            "lr",
            "lr_decay",
            "momentum",
            "weight_decay",
            "mixup",
            "mixup_alpha",
            "eval_batch_size",
            "rounds",
            "bn_buffers",
        )
    },
    **{
        key: ("run", key)
        for key in (
            "join_ratio",
            "eval_every",
            "eval_all_clients",
            "unseen_clients",
            "unseen_finetune_epochs",
            "unseen_finetune_steps",
            "unseen_finetune_lr",
            "engine",
            "workers",
            "device",
            "threads",
            "checkpoint_every",
            "state_store",
            "state_cache",
            "tracker",
            "plateau_evaluations",
            "plateau_points",
            "plateau_metric",
        )
    },
}

#: The sections that flat keys belong to.
SECTIONS = ("partition", "train", "run")

#: How the user wrote the settings of those sections: (section, field) -> ``lr`` or ``train.lr``.
Written = dict[tuple[str, ...], str]


def _is_flat(key: str, value: Any) -> bool:
    """Whether top-level ``key = value`` is a flat alias (``partition`` is one unless it is the table)."""
    return key in FLAT_KEYS and not (key == FLAT_KEYS[key][0] and isinstance(value, Mapping))


def nest(data: Mapping[str, Any], written: Written | None = None) -> dict[str, Any]:
    """``data`` with its flat keys moved into their sections (``lr`` -> ``[train] lr``); the
    spelling of every setting of those sections is recorded in ``written`` (a spelling already
    there stays). A setting given both ways is an error naming both."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items() if not _is_flat(k, v)}
    if written is not None:
        for section in SECTIONS:
            if isinstance(out.get(section), dict):
                for field in out[section]:
                    written.setdefault((section, field), f"{section}.{field}")
    for key, value in data.items():
        if not _is_flat(key, value):
            continue
        section, field = FLAT_KEYS[key]
        table = out.setdefault(section, {})
        if not isinstance(table, dict):
            raise ValueError(f"{key} is a key of the section {section}, but {section} = {table!r} is no table")
        if field in table:
            raise ValueError(
                f"{key} and {section}.{field} are the same setting ({key} is its flat spelling): set it once"
            )
        table[field] = value
        if written is not None:
            written[(section, field)] = key
    return out


def canonical_path(path: list[str], value: Any = None) -> list[str]:
    """The sectioned path of an override's key: ``["lr"]`` -> ``["train", "lr"]``."""
    if len(path) == 1 and _is_flat(path[0], value):
        return list(FLAT_KEYS[path[0]])
    return list(path)


def _named(info: ValidationInfo, section: str, field: str) -> str:
    """A setting's key as the user wrote it; its flat spelling where the default stands."""
    written = (info.context or {}).get("written") or {}
    if (section, field) in written:
        return written[(section, field)]
    return next((k for k, v in FLAT_KEYS.items() if v == (section, field)), f"{section}.{field}")

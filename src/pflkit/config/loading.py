"""Reading a config: a TOML file or table plus overrides, validated, with warnings for keys the
chosen settings never read; writing it back in its resolved form."""

from __future__ import annotations

import copy
import logging
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from ..data import PartitionSpec
from ..methods import REGISTRY, config_sections
from .aliases import FLAT_KEYS, Written, nest
from .errors import ConfigError, format_errors
from .overrides import apply_override, parse_override
from .schema import BaseConfig, config_model
from .sections import DataSettings

log = logging.getLogger(__name__)

#: [data] fields and the dataset that reads each
_DOMAIN_SETS = ("digit5", "office_caltech10", "domainnet")
_DATA_KEYS: dict[str, tuple[str, ...]] = {
    "emnist_split": ("emnist",),
    "synthetic_alpha": ("fedprox_synthetic",),
    "synthetic_beta": ("fedprox_synthetic",),
    "synthetic_iid": ("fedprox_synthetic",),
    "percent": ("digit5",),
    "classes": ("office_caltech10", "domainnet"),
    "image_size": ("office_caltech10", "domainnet"),
    "domains": _DOMAIN_SETS,
    "clients_per_domain": _DOMAIN_SETS,
    "heldout_domains": _DOMAIN_SETS,
}


def _pathological_rule(spec: PartitionSpec) -> bool:
    return spec.method == "pathological" or (spec.method == "iid" and spec.rng == "pfllib")


# [partition] fields that only one kind of partition or test set reads: field -> (what reads it, is it read?)
_PARTITION_KEYS: dict[str, tuple[str, Any]] = {
    "alpha": (
        "partition = dirichlet, label_dirichlet or exdir",
        lambda p: p.method in ("dirichlet", "label_dirichlet", "exdir"),
    ),
    "balance_cap": ("partition = dirichlet or exdir", lambda p: p.method in ("dirichlet", "exdir")),
    "num_folds": ("partition = kfold", lambda p: p.method == "kfold"),
    "primary_fraction": ("partition = kfold", lambda p: p.method == "kfold"),
    "classes_per_client": ("partition = pathological or exdir", lambda p: p.method in ("pathological", "exdir")),
    "shards_per_client": ("partition = shards", lambda p: p.method == "shards"),
    "quantity_sigma": ('quantity = "lognormal"', lambda p: p.quantity == "lognormal"),
    # PFLlib's iid is its pathological rule with every class
    "balanced": ("partition = pathological (or iid with partition_rng = pfllib)", _pathological_rule),
    "min_samples_per_client": (
        "partition = dirichlet, exdir or pathological (or iid with partition_rng = pfllib), or quantity = "
        '"lognormal" or "linear"',
        lambda p: p.method in ("dirichlet", "exdir") or _pathological_rule(p) or p.quantity in ("lognormal", "linear"),
    ),
    # the official split still sizes PFLlib's default minimum with it
    "train_fraction": (
        'test_set = "client_split", or the default minimum of partition = dirichlet or pathological',
        lambda p: (
            p.test_set == "client_split"
            or (p.min_samples_per_client is None and (p.method == "dirichlet" or _pathological_rule(p)))
        ),
    ),
}


def build_config(data: Mapping[str, Any], source: str = "config", written: Written | None = None) -> BaseConfig:
    """Validate a config table, flat keys or sections (``written``: how keys already moved into
    their sections were spelt, for the messages)."""
    written = dict(written or {})
    schema = config_model(data.get("algorithms"))
    try:
        return schema.model_validate(dict(data), context={"written": written})
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, source, written, schema)) from None


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's table, with errors naming the file."""
    path = Path(path)
    if not path.exists():
        packed = path.parent / "records.tar.xz"
        if path.name == "config.toml" and packed.is_file():  # pflkit pack moved it into the archive
            raise ConfigError(
                f"config file {path} is in {packed} (its results folder is packed): pflkit run and "
                f"pflkit config read it from there; elsewhere restore it first: pflkit unpack {path.parent}"
            )
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): TOML files are UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, data: Mapping[str, Any] | None = None
) -> BaseConfig:
    """Read a TOML file (none: all defaults, the digits demo), or take its already read ``data``,
    and apply dotted overrides (each replaces the file's value, whether either spells the key flat
    or in its section)."""
    source = "defaults" if path is None else str(path)
    data = dict(data) if data is not None else (read_toml(path) if path is not None else {})
    if "sweep" in data:
        raise ConfigError(f"{source} has a [sweep] table: it is a sweep file; run it with pflkit sweep")
    written: Written = {}
    try:
        data = nest(copy.deepcopy(data), written)
    except ValueError as exc:
        raise ConfigError(f"invalid configuration ({source}):\n  {exc}") from None
    for item in overrides:
        apply_override(data, item, written)
    if overrides:
        source += " + command-line overrides"
    config = build_config(data, source, written)
    typed = {parse_override(item)[0][0] for item in overrides}
    for line in unused_keys(data, config, typed, written):
        log.warning("%s: %s", source, line)
    return config


def _is_default(model: type[BaseModel], key: str, value: Any) -> bool:
    """Whether ``value`` is the field's default: a saved, resolved config writes every default,
    and reading it back must not warn about them."""
    field = model.model_fields.get(key)
    if field is None:
        return False
    if field.default_factory is not None:
        return bool(value == field.get_default(call_default_factory=True))
    return field.default is not PydanticUndefined and value == field.default


def unused_keys(
    data: Mapping[str, Any], config: BaseConfig, typed: set[str] | None = None, written: Written | None = None
) -> list[str]:
    """The keys set in ``data`` (flat or in sections) that the chosen setting never reads, each
    named as written with what would read it: a partition's parameter under another partition,
    and a method's section that no method in ``algorithms`` reads, where the user ``typed`` it on
    the command line (a paper config keeps the sections of all its methods, and running a few of
    them is ordinary)."""
    written = dict(written or {})
    data = nest(data, written)
    partition = data.get("partition")
    table = partition if isinstance(partition, dict) else {}
    lines = [
        f"{written[('partition', key)]} = {table[key]!r} is not used: only {reader} reads it"
        for key, (reader, used) in _PARTITION_KEYS.items()
        if key in table and not used(config.partition) and not _is_default(PartitionSpec, key, table[key])
    ]
    settings = data.get("data")
    lines += [
        f"data.{key} = {value!r} is not used: only dataset = {' or '.join(_DATA_KEYS[key])} reads it"
        for key, value in (settings.items() if isinstance(settings, dict) else ())
        if key in _DATA_KEYS and config.dataset not in _DATA_KEYS[key] and not _is_default(DataSettings, key, value)
    ]
    sections = config_sections(config.algorithms)
    read = set()
    for name in config.algorithms:
        read.update(REGISTRY.resolve(name).sections)
    for key in data:
        if key in sections and key not in read and (typed is None or key in typed):
            lines.append(f"[{key}] is not used: no method of algorithms = {list(config.algorithms)} reads it")
    return lines


def resolved(table: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A saved config table in its resolved, sectioned form (an older results folder's spells its keys
    flat), to compare with ``to_dict`` of a config; ConfigError if it no longer validates."""
    return to_dict(build_config(table, source))


def to_dict(config: BaseConfig) -> dict[str, Any]:
    """The fully resolved config (every default filled in) in its sectioned form, TOML-compatible
    (no None values)."""
    return _drop_none(config.model_dump(mode="json"))


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (_drop_none(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}


def describe_keys() -> list[tuple[str, str, Any, str]]:
    """Every key: (dotted key, its flat alias or "", default, description), sections in order."""
    flat = {v: k for k, v in FLAT_KEYS.items()}
    rows = []
    for name, field in config_model().model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            for key, sub in model.model_fields.items():
                rows.append(
                    (
                        f"{name}.{key}",
                        flat.get((name, key), ""),
                        sub.get_default(call_default_factory=True),
                        sub.description or "",
                    )
                )
        else:
            rows.append((name, "", field.get_default(call_default_factory=True), field.description or ""))
    return rows

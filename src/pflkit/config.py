"""Experiment configuration: a TOML file plus dotted ``key=value`` overrides, validated strictly.

A config names the experiment at its top level (``name``, ``dataset``, ``model``, ``algorithms``,
``seeds`` ...); its settings live in sections that are the lower layers' own settings classes:
``[partition]`` is the data layer's :class:`~pflkit.data.PartitionSpec`, ``[train]`` the
algorithms' :class:`~pflkit.algorithms.TrainSettings`, ``[run]`` (:class:`RunSettings`, here)
what the federation layer reads to execute the rounds. Per-algorithm sections (``[fedprox]``,
``[ditto]``, ``[fedala]`` ...) come from each algorithm's ``settings_class``, so adding an
algorithm adds its section here without editing this file.

The flat keys of earlier configs (``lr = 0.05``, ``partition = "pathological"``,
``join_ratio = 0.5`` ...) are aliases, listed once in :data:`FLAT_KEYS`: they are moved into
their sections before validation, and every message names a key as the user wrote it.
"""

from __future__ import annotations

import copy
import logging
import re

import difflib
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator,
                      model_validator)
from pydantic_core import PydanticUndefined

from .algorithms import Settings, TrainSettings
from .methods import REGISTRY, config_sections, parse_name
from .data import DATASETS, FILE_DATASETS, PartitionSpec
from .models import DEFAULT_MODEL, MODELS

log = logging.getLogger(__name__)

#: The flat keys users typed before the sections existed, still accepted at the top level (in
#: files, overrides, sweep grids and old results folders): flat key -> (section, field).
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "partition": ("partition", "method"), "partition_rng": ("partition", "rng"),
    "partition_seed": ("partition", "seed"),
    **{key: ("partition", key) for key in (
        "num_clients", "alpha", "classes_per_client", "balanced", "min_samples_per_client", "balance_cap",
        "train_fraction", "num_folds", "primary_fraction", "test_set")},
    **{key: ("train", key) for key in (
        "batch_size", "local_epochs", "lr", "lr_decay", "momentum", "weight_decay", "mixup", "mixup_alpha",
        "eval_batch_size", "rounds", "bn_buffers")},
    **{key: ("run", key) for key in (
        "join_ratio", "eval_every", "eval_all_clients", "engine", "workers", "device", "threads",
        "checkpoint_every", "state_store", "state_cache", "tracker", "plateau_evaluations", "plateau_points",
        "plateau_metric")},
}

#: The sections that flat keys belong to.
SECTIONS = ("partition", "train", "run")

#: How the user wrote the settings of those sections: (section, field) -> ``lr`` or ``train.lr``.
Written = dict[tuple[str, ...], str]


def _pathological_rule(spec: PartitionSpec) -> bool:
    return spec.method == "pathological" or (spec.method == "iid" and spec.rng == "pfllib")


# [partition] fields that only one kind of partition or test set reads: field -> (what reads it, is it read?)
_PARTITION_KEYS: dict[str, tuple[str, Any]] = {
    "alpha": ("partition = dirichlet or label_dirichlet", lambda p: p.method in ("dirichlet", "label_dirichlet")),
    "balance_cap": ("partition = dirichlet", lambda p: p.method == "dirichlet"),
    "num_folds": ("partition = kfold", lambda p: p.method == "kfold"),
    "primary_fraction": ("partition = kfold", lambda p: p.method == "kfold"),
    "classes_per_client": ("partition = pathological", lambda p: p.method == "pathological"),
    # PFLlib's iid is its pathological rule with every class
    "balanced": ("partition = pathological (or iid with partition_rng = pfllib)", _pathological_rule),
    "min_samples_per_client": ("partition = dirichlet or pathological (or iid with partition_rng = pfllib)",
                               lambda p: p.method == "dirichlet" or _pathological_rule(p)),
    # the official split still sizes PFLlib's default minimum with it
    "train_fraction": ('test_set = "client_split", or the default minimum of partition = dirichlet or pathological',
                       lambda p: p.test_set == "client_split" or (p.min_samples_per_client is None and (
                           p.method == "dirichlet" or _pathological_rule(p)))),
}


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key(s)."""


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
            raise ValueError(f"{key} and {section}.{field} are the same setting ({key} is its flat spelling): "
                             "set it once")
        table[field] = value
        if written is not None:
            written[(section, field)] = key
    return out


def canonical_path(path: list[str], value: Any = None) -> list[str]:
    """The sectioned path of an override's key: ``["lr"]`` -> ``["train", "lr"]``."""
    if len(path) == 1 and _is_flat(path[0], value):
        return list(FLAT_KEYS[path[0]])
    return list(path)


class MetricsSettings(BaseModel):
    """The ``[metrics]`` section: metrics that cost extra passes."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    adaptability: bool = Field(False, description="after training, score every participant's local model by "
                               "its risk over the clients' distributions and KL(P||T) (FedACD Tables 3 and 9; "
                               "a pass over its training data and the global test set; test_set = official)")
    template_gamma: float = Field(0.9, gt=0, lt=1, description="gamma of the template T of KL(P||T) "
                                  "(spec §3.9 [UNCERTAIN])")


class TraceSettings(BaseModel):
    """The ``[trace]`` section: clients whose models are saved every round (FedALA Fig. 4)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    clients: list[int] = Field(default_factory=list, description="client ids whose scored model is saved after "
                               "every round under trace/ in the results folder (pflkit plot trajectory; "
                               "simulator only)")


class RunSettings(BaseModel):
    """The ``[run]`` section, read by the federation layer and the executors: who trains and who
    is scored each round, on which engine and device, and how the run is checkpointed, stores
    client states and is tracked."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    join_ratio: float = Field(1.0, gt=0, le=1, description="share of the clients sampled each round")
    eval_every: int = Field(1, ge=1, description="rounds between evaluations")
    eval_all_clients: bool = Field(False, description="score every client at each evaluation, not only the "
                                   "next round's participants (SosicFL protocol; simulator only)")
    engine: Literal["auto", "loop", "parallel", "vmap"] = Field(
        "auto", description="loop: one client at a time; parallel: clients over worker threads; vmap: "
        "many clients batched with torch.func (for GPUs); auto: vmap on CUDA, parallel on CPU")
    workers: int | None = Field(None, ge=1, description="parallel engine workers (default: all cores)")
    device: str = Field("cpu", description="cpu, cuda, cuda:N or auto")
    threads: int = Field(1, ge=1, description="torch intra-op threads per worker (set explicitly; see docs)")
    checkpoint_every: int = Field(1, ge=1, description="rounds between checkpoints")
    state_store: Literal["memory", "disk"] = Field(
        "memory", description="where clients' states live between rounds: memory, or disk (one file per client "
        "under states/ in the results folder, read when sampled, written back after its round; checkpoints use "
        "the same files), for many stateful clients")
    state_cache: int | None = Field(None, ge=1, description="state_store = disk: client states kept in memory "
                                    "(default: the clients of one round, at most 64; a client's state is read when "
                                    "its job starts, so memory holds the clients in flight and this cache)")
    plateau_evaluations: int | None = Field(
        None, ge=1, description="stop a run once its best plateau_metric has not improved by more than "
        "plateau_points over the last this many evaluations (rounds is then the cap; FedALA's convergence rule: "
        "20; a method's own schedule, APPLE's lambda(r), is waited for); default: run every round")
    plateau_points: float = Field(0.1, ge=0, description="plateau rule: the improvement, in percentage points, "
                                  "that counts as progress")
    plateau_metric: Literal["accuracy", "global_accuracy", "local_accuracy"] = Field(
        "accuracy", description="plateau rule: the record's metric it watches (global_accuracy: methods without "
        "a global model fall back to accuracy)")
    tracker: Literal["none", "tensorboard"] = Field(
        "none", description="also write every record to TensorBoard event files under tensorboard/ in the results "
        "folder (needs the tensorboard extra: pip install 'pflkit[tensorboard]')")

    @field_validator("device")
    @classmethod
    def _device_syntax(cls, device: str) -> str:
        if device not in ("cpu", "cuda", "auto") and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError("device must be cpu, cuda, cuda:N or auto")
        return device


def _named(info: ValidationInfo, section: str, field: str) -> str:
    """A setting's key as the user wrote it; its flat spelling where the default stands."""
    written = (info.context or {}).get("written") or {}
    if (section, field) in written:
        return written[(section, field)]
    return next((k for k, v in FLAT_KEYS.items() if v == (section, field)), f"{section}.{field}")


class BaseConfig(BaseModel):
    """The experiment's identity and its sections (the per-algorithm sections are added below)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field("digits-demo", min_length=1, description="label used for the default results folder")
    paper_table: str | None = Field(None, description="the paper's cell this config reproduces, \"<table>/<column>\" "
                                    "(e.g. fedala-table2/cifar10-dir0.1): pflkit report sets its numbers beside ours")
    dataset: Literal[DATASETS] = "digits"  # type: ignore[valid-type]
    data_dir: str | None = Field(None, description="folder with the dataset's files (every dataset but digits "
                                 "and synthetic)")
    model: str = Field("auto", description="model name, or auto: digits_cnn for 8x8, fedavg_cnn for images, "
                       "fasttext for AG News; pfllib: by its data")
    pretrained: str | None = Field(None, description="a local state dict in torchvision's key layout (ImageNet "
                                   "weights) to start the model from; a head of another size stays freshly "
                                   "initialised (SosicFL Table 3: squeezenet1_1, resnet18)")
    algorithms: list[str] = Field(default_factory=lambda: ["fedavg", "fedprox", "ditto", "fedrep", "fedala"],
                                  min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    partition: PartitionSpec = Field(default_factory=lambda: PartitionSpec(),
                                     description="how the data is split over clients")
    train: TrainSettings = Field(default_factory=lambda: TrainSettings(), description="local training")
    run: RunSettings = Field(default_factory=lambda: RunSettings(), description="how the rounds execute")

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data: Any, info: ValidationInfo) -> Any:
        """The flat aliases (``lr``, ``partition``, ...) moved into their sections."""
        if not isinstance(data, Mapping):
            return data
        written = (info.context or {}).get("written")
        return nest(data, written)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if name in (".", "..") or any(c in name for c in "/\\\0") or len(name) > 100:
            raise ValueError("must be a plain folder name (no path separators, not '.' or '..', at most 100 "
                             "characters): it names the default results folder results/<name>-<timestamp>")
        return name

    @model_validator(mode="after")
    def _data_dir_is_read(self) -> "BaseConfig":
        if self.data_dir and self.dataset not in FILE_DATASETS:
            raise ValueError(f"data_dir is set ({self.data_dir!r}) but dataset = {self.dataset!r} reads no files "
                             f"(it is built in); set the dataset that lives there (e.g. dataset=mnist), or drop "
                             "data_dir")
        return self

    @field_validator("paper_table")
    @classmethod
    def _paper_table_form(cls, name: str | None) -> str | None:
        # which tables exist is the reporting layer's knowledge: `pflkit run`, `sweep` and `report`
        # check the name against it before anything runs
        if name is not None and not re.fullmatch(r"[^/\s]+/[^/\s]+", name):
            raise ValueError(f"must be \"<table>/<column>\" (e.g. fedala-table2/cifar10-dir0.1), got {name!r}")
        return name

    @field_validator("algorithms")
    @classmethod
    def _known_algorithms(cls, names: list[str]) -> list[str]:
        for name in names:
            parse_name(name)
        if len(set(names)) != len(names):
            raise ValueError("algorithms contains duplicates")
        return names

    @model_validator(mode="after")
    def _full_participation(self, info: ValidationInfo) -> "BaseConfig":
        for name in self.algorithms:
            if REGISTRY.method_class(name).requires_full_participation and self.run.join_ratio < 1:
                raise ValueError(f"algorithm {name!r} needs every client in every round (cross-silo, spec §2): "
                                 f"{_named(info, 'run', 'join_ratio')} must be 1, got {self.run.join_ratio}")
        return self

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError("seeds contains duplicates")
        return seeds

    @field_validator("model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        if name != "auto" and name not in MODELS:
            raise ValueError(f"unknown model; available: auto, {', '.join(sorted(MODELS))}")
        return name

    metrics: MetricsSettings = Field(default_factory=lambda: MetricsSettings(),
                                     description="optional, costly metrics")
    trace: TraceSettings = Field(default_factory=lambda: TraceSettings(), description="models saved per round")

    @model_validator(mode="after")
    def _traced_clients_exist(self, info: ValidationInfo) -> "BaseConfig":
        clients = self.partition.num_clients
        wrong = [c for c in self.trace.clients if not 0 <= c < clients]
        if wrong:
            raise ValueError(f"trace.clients {wrong} are not clients of this run (ids 0..{clients - 1}, "
                             f"{_named(info, 'partition', 'num_clients')} = {clients})")
        return self

    @model_validator(mode="after")
    def _adaptability_needs_the_official_test_set(self, info: ValidationInfo) -> "BaseConfig":
        if self.metrics.adaptability and not self.partition.official:
            raise ValueError("metrics.adaptability scores local models on the global test set: it needs "
                             f"{_named(info, 'partition', 'test_set')} = \"official\"")
        return self

    @model_validator(mode="after")
    def _official_needs_a_pool(self, info: ValidationInfo) -> "BaseConfig":
        if self.partition.official and self.dataset == "pfllib":
            key = _named(info, "partition", "test_set")
            raise ValueError(f"{key} = \"official\" needs the dataset's official test split, and a PFLlib "
                             f"folder holds only per-client splits: use {key} = \"client_split\" or a dataset")
        return self

    @model_validator(mode="after")
    def _dataset_needs(self) -> "BaseConfig":
        if self.dataset in FILE_DATASETS and not self.data_dir:
            hint = "" if self.dataset == "pfllib" else \
                f" (`pflkit download {self.dataset} DIR` fetches them where a network exists)"
            raise ValueError(f"dataset {self.dataset!r} needs data_dir: a folder with "
                             f"{FILE_DATASETS[self.dataset]}{hint}")
        return self

    @property
    def resolved_model(self) -> str:
        """The model name; ``auto`` on pfllib depends on the data: use :meth:`model_for` there."""
        if self.model != "auto":
            return self.model
        if self.dataset not in DEFAULT_MODEL:
            raise ConfigError(f"model=auto for dataset {self.dataset!r} depends on its data: use model_for")
        return DEFAULT_MODEL[self.dataset]

    def model_for(self, input_shape: tuple[int, ...]) -> str:
        """The model for samples of ``input_shape``: pfllib + auto picks fedavg_cnn (images) or fasttext (ids)."""
        if self.model == "auto" and self.dataset == "pfllib":
            return "fedavg_cnn" if len(input_shape) == 3 else "fasttext"
        return self.resolved_model

    def algorithm_sections(self) -> dict[str, Settings]:
        """Every method section of this config (pflkit's and those of its outside methods)."""
        return {name: getattr(self, name) for name in config_sections(self.algorithms)}


_MODELS: dict[tuple[tuple[str, type[Settings]], ...], type[BaseConfig]] = {}


def config_model(algorithms: Any = ()) -> type[BaseConfig]:
    """The config schema: the experiment's keys and one section per method, pflkit's own and those
    of the outside methods (dotted paths, entry points) named in ``algorithms``; names that do not
    resolve are left to the validation's message."""
    outside = {}
    for name in algorithms if isinstance(algorithms, (list, tuple)) else ():
        try:
            resolved = REGISTRY.resolve(name) if isinstance(name, str) else None
        except ValueError:
            continue
        if resolved is not None and resolved.external:
            outside[resolved.cls.section or resolved.cls.name] = resolved.cls.settings_class
    key = tuple(sorted(outside.items(), key=lambda item: item[0]))
    if key not in _MODELS:
        sections = {**config_sections(), **outside}
        fields: dict[str, Any] = {name: (cls, cls()) for name, cls in sections.items()}
        _MODELS[key] = create_model("ExperimentConfig", __base__=BaseConfig, **fields)  # type: ignore[call-overload]
    return _MODELS[key]


def __getattr__(name: str) -> Any:
    if name == "ExperimentConfig":  # the schema of pflkit's own methods
        return config_model()
    raise AttributeError(name)


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


def format_errors(error: ValidationError, source: str, written: Written | None = None,
                  schema: type[BaseModel] | None = None) -> str:
    """One line per problem, each naming the key as the user wrote it (``written``: see
    :func:`nest`), what it must be and the value given (``schema``: the config model validated)."""
    schema = schema or config_model()
    lines = [f"invalid configuration ({source}):"]
    for err in error.errors():
        if not err["loc"]:  # a rule across keys: its message names them
            lines.append(f"  {_message(err, schema)}")
            continue
        lines.append(f"  {_as_written(tuple(err['loc']), written or {})}: {_message(err, schema)} "
                     f"(got {err.get('input')!r})")
    return "\n".join(lines)


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


def apply_override(data: dict[str, Any], item: str, written: Written) -> None:
    """Set override ``item`` in the sectioned table ``data``, whatever the spelling of its key
    (``lr=0.05`` and ``train.lr=0.05`` replace the same setting), and record the spelling."""
    path, value = parse_override(item)
    target = canonical_path(path, value)
    merge(data, target, value)
    replaced = [tuple(target)] if not isinstance(value, dict) else [(*target, field) for field in value]
    for key in [k for k in written if any(k[:len(r)] == r for r in replaced)]:
        del written[key]
    if len(target) == 2 and target[0] in SECTIONS:
        written[(target[0], target[1])] = ".".join(path)
    elif len(target) == 1 and target[0] in SECTIONS and isinstance(value, dict):
        written.update({(target[0], field): f"{target[0]}.{field}" for field in value})


def load_config(path: str | Path | None = None, overrides: list[str] = (), *,
                data: Mapping[str, Any] | None = None) -> BaseConfig:
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
    return field is not None and field.default is not PydanticUndefined and value == field.default


def unused_keys(data: Mapping[str, Any], config: BaseConfig, typed: set[str] | None = None,
                written: Written | None = None) -> list[str]:
    """The keys set in ``data`` (flat or in sections) that the chosen setting never reads, each
    named as written with what would read it: a partition's parameter under another partition,
    and a method's section that no method in ``algorithms`` reads, where the user ``typed`` it on
    the command line (a paper config keeps the sections of all its methods, and running a few of
    them is ordinary)."""
    written = dict(written or {})
    data = nest(data, written)
    table = data.get("partition") if isinstance(data.get("partition"), dict) else {}
    lines = [f"{written[('partition', key)]} = {table[key]!r} is not used: only {reader} reads it"
             for key, (reader, used) in _PARTITION_KEYS.items()
             if key in table and not used(config.partition) and not _is_default(PartitionSpec, key, table[key])]
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
                rows.append((f"{name}.{key}", flat.get((name, key), ""), sub.get_default(call_default_factory=True),
                             sub.description or ""))
        else:
            rows.append((name, "", field.get_default(call_default_factory=True), field.description or ""))
    return rows

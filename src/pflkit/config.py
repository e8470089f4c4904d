"""Experiment configuration: a TOML file plus dotted ``key=value`` overrides, validated strictly.

Every key, its default and its range live in ``ExperimentConfig``; per-algorithm sections
(``[fedprox]``, ``[ditto]``, ``[fedala]`` ...) come from each algorithm's ``settings_class``, so
adding an algorithm adds its section here without editing this file.
"""

from __future__ import annotations

import copy
import logging

import difflib
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from . import personalize  # noqa: F401  (registers the +ala modifier and its [fedala] section)
from .algorithms import ALGORITHMS, Settings, config_sections, parse_name
from .data import DATASETS, FILE_DATASETS
from .models import DEFAULT_MODEL, MODELS

log = logging.getLogger(__name__)

# keys that only one kind of partition or test set reads: key -> (what reads it, is it read here?)
_PARTITION_KEYS: dict[str, tuple[str, Any]] = {
    "alpha": ("partition = dirichlet or label_dirichlet", lambda c: c.partition in ("dirichlet", "label_dirichlet")),
    "balance_cap": ("partition = dirichlet", lambda c: c.partition == "dirichlet"),
    "num_folds": ("partition = kfold", lambda c: c.partition == "kfold"),
    "primary_fraction": ("partition = kfold", lambda c: c.partition == "kfold"),
    "classes_per_client": ("partition = pathological", lambda c: c.partition == "pathological"),
    # PFLlib's iid is its pathological rule with every class
    "balanced": ("partition = pathological (or iid with partition_rng = pfllib)", lambda c: _pathological_rule(c)),
    "min_samples_per_client": ("partition = dirichlet or pathological (or iid with partition_rng = pfllib)",
                               lambda c: c.partition == "dirichlet" or _pathological_rule(c)),
    # the official split still sizes PFLlib's default minimum with it
    "train_fraction": ('test_set = "client_split", or the default minimum of partition = dirichlet or pathological',
                       lambda c: c.test_set == "client_split" or (c.min_samples_per_client is None and (
                           c.partition == "dirichlet" or _pathological_rule(c)))),
}


def _pathological_rule(config: Any) -> bool:
    return config.partition == "pathological" or (config.partition == "iid" and config.partition_rng == "pfllib")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key(s)."""


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


class BaseConfig(BaseModel):
    """Keys shared by every experiment (the per-algorithm sections are added below)."""

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
    num_clients: int = Field(20, ge=1)
    partition: Literal["iid", "dirichlet", "pathological", "kfold", "label_dirichlet"] = Field(
        "dirichlet", description="iid; dirichlet (class-wise, PFLlib, spec §5.4); pathological (spec §5.2); "
        "kfold (SosicFL's k-Fold groups, spec §5.3); label_dirichlet (client-wise Dir over label "
        "distributions with equal client sizes, SosicFL, spec §5.6)")
    alpha: float = Field(0.1, gt=0, description="Dirichlet concentration (spec §5.4; label_dirichlet: §5.6)")
    num_folds: int = Field(2, ge=1, description="kfold: G groups of clients and of primary classes")
    primary_fraction: float = Field(0.8, gt=0, le=1, description="kfold: share of a client's samples from its "
                                    "group's primary classes (the rest spread evenly over the others)")
    classes_per_client: int = Field(2, ge=1, description="pathological: classes per client (spec §5.2)")
    balanced: bool = Field(False, description="pathological: equal shares instead of PFLlib's random sizes")
    min_samples_per_client: int | None = Field(
        None, ge=0, description="dirichlet/pathological minimum samples per client; default PFLlib's "
        "int(min(batch_size / (1 - train_fraction), samples / num_clients / 2)), lowered with a logged "
        "warning to one training batch + one test sample where no draw reaches it (spec §5.4)")
    balance_cap: bool = Field(True, description="dirichlet: stop feeding clients that hold the average share "
                              "(PFLlib; spec §5.4 [UNCERTAIN] for FedACD's splits)")
    partition_rng: Literal["pflkit", "pfllib"] = Field(
        "pflkit", description="random convention of the partition: pflkit's seeded streams, or PFLlib's "
        "np.random.seed(partition_seed) order, which reproduces PFLlib's generated split of the same pool")
    train_fraction: float = Field(0.75, gt=0, lt=1, description="per-client train share (spec §5.5; "
                                  "test_set = client_split only)")
    test_set: Literal["client_split", "official"] = Field(
        "client_split", description="client_split: every client's samples split train/test (FedALA, spec §5.5); "
        "official: the official training split is partitioned, the official test split is the global test "
        "set and each client gets a local test set with its label proportions (spec §5.6)")
    partition_seed: int | None = Field(None, description="seed of the partition; default: each run seed")
    rounds: int = Field(60, ge=1)
    algorithms: list[str] = Field(default_factory=lambda: ["fedavg", "fedprox", "ditto", "fedrep", "fedala"],
                                  min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    batch_size: int = Field(10, ge=1)
    local_epochs: int = Field(1, ge=1)
    lr: float = Field(0.1, gt=0)
    lr_decay: float = Field(1.0, gt=0, le=1, description="per-round learning-rate factor: round r trains at "
                            "lr * lr_decay**(r - 1) (FedNH's and FedNTD's code: 0.99; 1: constant)")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (optimiser state starts fresh every round)")
    weight_decay: float = Field(0.0, ge=0, description="SGD weight decay (L2 added to the gradient)")
    mixup: bool = Field(False, description="input mixup in every local training batch (Zhang et al. 2018; "
                        "FedACD Table 5)")
    mixup_alpha: float = Field(1.0, gt=0, description="mixup: lambda ~ Beta(mixup_alpha, mixup_alpha)")
    join_ratio: float = Field(1.0, gt=0, le=1)
    eval_every: int = Field(1, ge=1)
    eval_all_clients: bool = Field(False, description="score every client at each evaluation, not only the "
                                   "next round's participants (SosicFL protocol; simulator only)")
    eval_batch_size: int = Field(1000, ge=1)
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
                                    "(default: the clients of one round)")
    tracker: Literal["none", "tensorboard"] = Field(
        "none", description="also write every record to TensorBoard event files under tensorboard/ in the results "
        "folder (needs the tensorboard extra: pip install 'pflkit[tensorboard]')")
    bn_buffers: Literal["local", "global"] = Field(
        "local", description="batch-norm running statistics: kept by each client (local, reference behaviour) "
        "or downloaded with the global model (global); the server averages them either way (spec §0.2)")

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
    def _known_paper_table(cls, name: str | None) -> str | None:
        if name is not None:
            from .reporting.paper import paper_cell
            paper_cell(name)
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
    def _full_participation(self) -> "BaseConfig":
        for name in self.algorithms:
            if ALGORITHMS[parse_name(name)[0]].requires_full_participation and self.join_ratio < 1:
                raise ValueError(f"algorithm {name!r} needs every client in every round (cross-silo, spec §2): "
                                 f"join_ratio must be 1, got {self.join_ratio}")
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

    @field_validator("device")
    @classmethod
    def _device_syntax(cls, device: str) -> str:
        if device not in ("cpu", "cuda", "auto") and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError("device must be cpu, cuda, cuda:N or auto")
        return device

    metrics: MetricsSettings = Field(default_factory=lambda: MetricsSettings(),
                                     description="optional, costly metrics")
    trace: TraceSettings = Field(default_factory=lambda: TraceSettings(), description="models saved per round")

    @model_validator(mode="after")
    def _traced_clients_exist(self) -> "BaseConfig":
        wrong = [c for c in self.trace.clients if not 0 <= c < self.num_clients]
        if wrong:
            raise ValueError(f"trace.clients {wrong} are not clients of this run (ids 0..{self.num_clients - 1})")
        return self

    @model_validator(mode="after")
    def _adaptability_needs_the_official_test_set(self) -> "BaseConfig":
        if self.metrics.adaptability and self.test_set != "official":
            raise ValueError("metrics.adaptability scores local models on the global test set: it needs "
                             "test_set = \"official\"")
        return self

    @model_validator(mode="after")
    def _official_needs_a_pool(self) -> "BaseConfig":
        if self.test_set == "official" and self.dataset == "pfllib":
            raise ValueError("test_set = \"official\" needs the dataset's official test split, and a PFLlib "
                             "folder holds only per-client splits: use test_set = \"client_split\" or a dataset")
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
        return {name: getattr(self, name) for name in config_sections()}


def _sections() -> dict[str, Any]:
    fields: dict[str, Any] = {name: (cls, cls()) for name, cls in config_sections().items()}
    return fields


ExperimentConfig = create_model("ExperimentConfig", __base__=BaseConfig, **_sections())  # type: ignore[call-overload]


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
    node = base
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {part} is not a section")
        node = child
    node[path[-1]] = value


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed next to the unknown one at ``loc`` (top level or a section)."""
    model: Any = ExperimentConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def _message(err: Mapping[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        known = _known_keys(tuple(err["loc"]))
        close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
        return "unknown key" + (f" (did you mean {close[0]!r}?)" if close else "")
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"must be {_BOUNDS[kind]} {bound}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    return str(err["msg"]).removeprefix("Value error, ")


def format_errors(error: ValidationError, source: str) -> str:
    """One line per problem, each naming the key, what it must be and the value given."""
    lines = [f"invalid configuration ({source}):"]
    for err in error.errors():
        if not err["loc"]:  # a rule across keys: its message names them
            lines.append(f"  {_message(err)}")
            continue
        loc = ".".join(str(p) for p in err["loc"])
        lines.append(f"  {loc}: {_message(err)} (got {err.get('input')!r})")
    return "\n".join(lines)


def build_config(data: Mapping[str, Any], source: str = "config") -> BaseConfig:
    try:
        return ExperimentConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, source)) from None


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


def load_config(path: str | Path | None = None, overrides: list[str] = (), *,
                data: Mapping[str, Any] | None = None) -> BaseConfig:
    """Read a TOML file (none: all defaults, the digits demo), or take its already read ``data``,
    and apply dotted overrides."""
    source = "defaults" if path is None else str(path)
    data = dict(data) if data is not None else (read_toml(path) if path is not None else {})
    if "sweep" in data:
        raise ConfigError(f"{source} has a [sweep] table: it is a sweep file; run it with pflkit sweep")
    data = copy.deepcopy(data)
    for item in overrides:
        merge(data, *parse_override(item))
    if overrides:
        source += " + command-line overrides"
    config = build_config(data, source)
    typed = {parse_override(item)[0][0] for item in overrides}
    for line in unused_keys(data, config, typed):
        log.warning("%s: %s", source, line)
    return config


def unused_keys(data: Mapping[str, Any], config: BaseConfig, typed: set[str] | None = None) -> list[str]:
    """The keys set in ``data`` that the chosen setting never reads, each with what would read it:
    a partition's parameter under another partition, and a method's section that no method in
    ``algorithms`` reads, where the user ``typed`` it on the command line (a paper config keeps the
    sections of all its methods, and running a few of them is ordinary)."""
    lines = [f"{key} = {data[key]!r} is not used: only {reader} reads it"
             for key, (reader, used) in _PARTITION_KEYS.items() if key in data and not used(config)]
    sections = config_sections()
    read = set()
    for name in config.algorithms:
        base, modifiers = parse_name(name)
        read.add(ALGORITHMS[base].section or base)
        read.update(m.section for m in modifiers)
    for key in data:
        if key in sections and key not in read and (typed is None or key in typed):
            lines.append(f"[{key}] is not used: no method of algorithms = {list(config.algorithms)} reads it")
    return lines


def to_dict(config: BaseConfig) -> dict[str, Any]:
    """The fully resolved config (every default filled in), TOML-compatible (no None values)."""
    return _drop_none(config.model_dump(mode="json"))


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (_drop_none(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}

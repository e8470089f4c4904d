"""The config schema: the experiment's keys, its sections, and one section per method (pflkit's
own, and those of the outside methods a config names), with the rules across keys."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator, model_validator

from ..algorithms import Settings, TrainSettings
from ..data import FILE_DATASETS, NATURAL_DATASETS, PartitionSpec
from ..data.domain_sets import DOMAIN_DATASETS
from ..data.domains import FeatureShift
from ..data.sources import DatasetName
from ..methods import REGISTRY, config_sections, parse_name
from ..models import DEFAULT_MODEL, MODELS
from .aliases import _named, nest
from .errors import ConfigError
from .sections import DataSettings, MetricsSettings, RunSettings, TraceSettings


class BaseConfig(BaseModel):
    """The experiment's identity and its sections (the per-algorithm sections are added below)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field("digits-demo", min_length=1, description="label used for the default results folder")
    paper_table: str | None = Field(
        None,
        description='the paper\'s cell this config reproduces, "<table>/<column>" '
        "(e.g. fedala-table2/cifar10-dir0.1): pflkit report sets its numbers beside ours",
    )
    dataset: DatasetName = Field(
        "digits",
        description="digits (scikit-learn's 8x8 digits, no download), synthetic, mnist, fashion_mnist, emnist, "
        "svhn, usps, cifar10, cinic10, cifar100, tiny_imagenet, agnews; with their own clients (no label "
        "partition): pfllib (a folder PFLlib "
        "generated, in data_dir), LEAF's femnist, shakespeare, sent140, leaf (numeric sets in LEAF's "
        "format: pFedMe's MNIST and Synthetic), fedprox_synthetic (Synthetic(alpha, beta), generated: "
        "[data] keys, num_clients clients, drawn from the partition seed), and the multi-domain digit5 "
        "(FedBN's Digit-5 pickles), office_caltech10 and domainnet (folder trees): a client per domain "
        "([data] keys domains, clients_per_domain, heldout_domains)",
    )
    data_dir: str | None = Field(
        None, description="folder with the dataset's files (every dataset but digits, synthetic and fedprox_synthetic)"
    )
    model: str = Field(
        "auto",
        description="model name (char_lstm, cifar_cnn, conv2cifar, digits_cnn, dnn, fasttext, fedavg_cnn, "
        "fedavg_cnn_bn, fedbn_cnn, lenet5, mclr, mobilenet_v2, resnet18, resnet18_gn, simple_cnn, squeezenet1_1), "
        "or auto: digits_cnn for 8x8, fedavg_cnn for images, fedbn_cnn for digit5, resnet18 for "
        "office_caltech10 and domainnet, "
        "fasttext for AG News and Sent140, char_lstm for Shakespeare, mclr for fedprox_synthetic; "
        "pfllib and leaf: by their data",
    )
    pretrained: str | None = Field(
        None,
        description="a local state dict in torchvision's key layout (ImageNet "
        "weights) to start the model from; a head of another size stays freshly "
        "initialised (SosicFL Table 3: squeezenet1_1, resnet18)",
    )
    algorithms: list[str] = Field(
        default_factory=lambda: ["fedavg", "fedprox", "ditto", "fedrep", "fedala"],
        min_length=1,
        description="the methods to run on the same partition (pflkit algorithms lists the names; "
        "<method>+ala adds FedALA's adaptive local aggregation)",
    )
    seeds: list[int] = Field(
        default_factory=lambda: [0],
        min_length=1,
        description="one run of every method per seed; the summary is the mean ± std over them",
    )
    partition: PartitionSpec = Field(
        default_factory=lambda: PartitionSpec(), description="how the data is split over clients"
    )
    feature_shift: FeatureShift = Field(
        default_factory=lambda: FeatureShift(),
        description="feature shift: each client's train and test images transformed into its own domain "
        "(rotation, inversion, tint, noise), on top of any partition",
    )
    train: TrainSettings = Field(default_factory=lambda: TrainSettings(), description="local training")
    run: RunSettings = Field(default_factory=lambda: RunSettings(), description="how the rounds execute")
    data: DataSettings = Field(default_factory=lambda: DataSettings(), description="settings of particular datasets")

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
        if (
            name in (".", "..")
            or any(c in name for c in "/\\\0")
            or len(name) > 100
            or any(not c.isprintable() for c in name)
        ):
            raise ValueError(
                "must be a plain folder name (no path separators or control characters such as a "
                "newline, not '.' or '..', at most 100 characters): it names the default results "
                "folder results/<name>-<timestamp>"
            )
        return name

    @model_validator(mode="after")
    def _data_dir_is_read(self) -> BaseConfig:
        if self.data_dir and self.dataset not in FILE_DATASETS:
            raise ValueError(
                f"data_dir is set ({self.data_dir!r}) but dataset = {self.dataset!r} reads no files "
                f"(it is built in); set the dataset that lives there (e.g. dataset=mnist), or drop "
                "data_dir"
            )
        return self

    @field_validator("paper_table")
    @classmethod
    def _paper_table_form(cls, name: str | None) -> str | None:
        # which tables exist is the reporting layer's knowledge: `pflkit run`, `sweep` and `report`
        # check the name against it before anything runs
        if name is not None and not re.fullmatch(r"[^/\s]+/[^/\s]+", name):
            raise ValueError(f'must be "<table>/<column>" (e.g. fedala-table2/cifar10-dir0.1), got {name!r}')
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
    def _full_participation(self, info: ValidationInfo) -> BaseConfig:
        for name in self.algorithms:
            if REGISTRY.method_class(name).requires_full_participation and self.run.join_ratio < 1:
                raise ValueError(
                    f"algorithm {name!r} needs every client in every round (cross-silo): "
                    f"{_named(info, 'run', 'join_ratio')} must be 1, got {self.run.join_ratio}"
                )
        return self

    def heldout_domain_ids(self) -> list[int]:
        """The clients of ``data.heldout_domains`` (a multi-domain dataset's clients go domain by
        domain, ``clients_per_domain`` each, in the order of ``data.domains``)."""
        if self.dataset not in DOMAIN_DATASETS or not self.data.heldout_domains:
            return []
        m = self.data.clients_per_domain
        domains = self.data.domains or list(DOMAIN_DATASETS[self.dataset])
        return [i * m + j for i, d in enumerate(domains) if d in self.data.heldout_domains for j in range(m)]

    def client_count(self) -> int | None:
        """The number of clients the run will have: ``num_clients``, or a domain dataset's domains
        times ``data.clients_per_domain``; None where only the data says (a PFLlib or LEAF folder's
        clients replace ``num_clients`` once it is read)."""
        if self.dataset in DOMAIN_DATASETS:
            return len(self.data.domains or DOMAIN_DATASETS[self.dataset]) * self.data.clients_per_domain
        if self.dataset in NATURAL_DATASETS and self.dataset != "fedprox_synthetic":
            return None
        return self.partition.num_clients

    def unseen_client_ids(self) -> list[int]:
        """The clients that never train: ``[run] unseen_clients`` and the clients of the held-out
        domains (``data.heldout_domains``), sorted."""
        clients = self.partition.num_clients
        held = self.heldout_domain_ids()
        if self.dataset in DOMAIN_DATASETS:  # num_clients becomes the domains' count once the data is read
            domains = self.data.domains or list(DOMAIN_DATASETS[self.dataset])
            clients = self.client_count() or clients
            if set(domains) <= set(self.data.heldout_domains):
                return held  # every domain held out: the domains' own check says so
        ids = sorted(set(self.run.unseen_ids(clients)) | set(held))
        if len(ids) >= clients:
            raise ValueError(
                f"{len(ids)} unseen clients of {clients} (held-out domains included) leave none to train: "
                "keep at least one participant"
            )
        return ids

    @model_validator(mode="after")
    def _unseen_clients(self, info: ValidationInfo) -> BaseConfig:
        key = _named(info, "run", "unseen_clients")
        try:  # a PFLlib or LEAF folder's clients are counted once it is read (check_data_clients)
            ids = self.unseen_client_ids() if self.client_count() is not None else self.run.unseen_ids(None)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
        for name in self.algorithms if ids else ():
            reason = REGISTRY.method_class(name).newcomer_refusal
            if reason is not None:
                raise ValueError(
                    f"algorithm {name!r} has no model for a client that never trained ({reason}): "
                    f"drop it or set {key} = 0"
                )
        return self

    @model_validator(mode="after")
    def _dropout_fits(self, info: ValidationInfo) -> BaseConfig:
        run = self.run
        for key, on in (
            ("dropout_rate", run.dropout_rate > 0),
            ("dropout_schedule", bool(run.dropout_schedule)),
            ("tolerate_failures", run.tolerate_failures),
            ("deadline_policy", run.round_deadline is not None and run.deadline_policy == "drop"),
        ):
            for name in self.algorithms if on else []:
                if REGISTRY.method_class(name).requires_full_participation:
                    raise ValueError(
                        f"algorithm {name!r} needs every client's upload in every round: it cannot run with "
                        f"{_named(info, 'run', key)} = {getattr(run, key)!r}"
                    )
        clients, rounds = self.client_count(), self.train.rounds
        for r, c in run.dropout_schedule:  # (a PFLlib or LEAF folder's clients are checked once it is read)
            known = c >= 0 and (clients is None or c < clients)
            if not (known and 1 <= r <= rounds):
                span = "" if clients is None else f"clients 0..{clients - 1} and "
                raise ValueError(
                    f"{_named(info, 'run', 'dropout_schedule')} names client {c} in round {r}, but the run has "
                    f"{span}rounds 1..{rounds}"
                )
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

    metrics: MetricsSettings = Field(default_factory=lambda: MetricsSettings(), description="optional, costly metrics")
    trace: TraceSettings = Field(default_factory=lambda: TraceSettings(), description="models saved per round")

    @model_validator(mode="after")
    def _traced_clients_exist(self, info: ValidationInfo) -> BaseConfig:
        clients = self.client_count()
        if clients is not None:  # else checked once the folder is read (check_data_clients)
            self._check_traced_clients(clients, f"{_named(info, 'partition', 'num_clients')} = {clients}")
        return self

    def _check_traced_clients(self, clients: int, source: str) -> None:
        wrong = [c for c in self.trace.clients if not 0 <= c < clients]
        if wrong:
            raise ValueError(f"trace.clients {wrong} are not clients of this run (ids 0..{clients - 1}, {source})")

    def check_data_clients(self, source: str) -> None:
        """Check the settings that name clients (``run.unseen_clients``, ``trace.clients``) against
        ``num_clients`` once it is the count the data gave (a PFLlib or LEAF folder's, ``source``);
        ValueError naming the key otherwise (``run.dropout_schedule``: the round driver checks it)."""
        clients = self.partition.num_clients
        try:
            self.unseen_client_ids()
        except ValueError as exc:
            raise ValueError(f"run.unseen_clients: {exc} ({source})") from None
        self._check_traced_clients(clients, source)

    @model_validator(mode="after")
    def _adaptability_needs_the_official_test_set(self, info: ValidationInfo) -> BaseConfig:
        if self.metrics.adaptability and not self.partition.official:
            raise ValueError(
                "metrics.adaptability scores local models on the global test set: it needs "
                f'{_named(info, "partition", "test_set")} = "official"'
            )
        return self

    @model_validator(mode="after")
    def _plateau_metric_is_recorded(self, info: ValidationInfo) -> BaseConfig:
        metric = self.run.plateau_metric
        if self.run.plateau_evaluations is not None and metric != "accuracy" and not self.partition.official:
            raise ValueError(
                f"{_named(info, 'run', 'plateau_metric')} = {metric!r} is recorded only under "
                f'{_named(info, "partition", "test_set")} = "official" (the global test set), so the '
                'plateau rule would never fire: use test_set = "official" or plateau_metric = '
                '"accuracy"'
            )
        return self

    @model_validator(mode="after")
    def _official_needs_a_pool(self, info: ValidationInfo) -> BaseConfig:
        if self.partition.official and self.dataset in NATURAL_DATASETS:
            key = _named(info, "partition", "test_set")
            holder = "a PFLlib folder" if self.dataset == "pfllib" else f"dataset {self.dataset!r}"
            raise ValueError(
                f'{key} = "official" needs the dataset\'s official test split, and {holder} '
                f'holds only per-client splits: use {key} = "client_split" or a dataset'
            )
        return self

    @model_validator(mode="after")
    def _feature_shift_fits(self, info: ValidationInfo) -> BaseConfig:
        shift = self.feature_shift
        if shift.active and self.dataset == "agnews":
            raise ValueError(
                f"feature_shift.transforms = {shift.transforms} changes images, but dataset 'agnews' holds "
                "token ids: drop feature_shift.transforms"
            )
        if shift.active and self.dataset in DOMAIN_DATASETS:
            try:
                count = len(self.data.domain_options().chosen(self.dataset)) * self.data.clients_per_domain
            except ValueError:
                return self  # _domains_exist names the unknown domain
            shift.check_clients(count, f"the clients of {self.dataset} (domains x clients_per_domain)")
        elif shift.active and self.client_count() is not None:  # a folder's clients are checked when read
            shift.check_clients(self.partition.num_clients, _named(info, "partition", "num_clients"))
        return self

    @model_validator(mode="after")
    def _domains_exist(self, info: ValidationInfo) -> BaseConfig:
        if self.dataset not in DOMAIN_DATASETS:
            return self
        known = DOMAIN_DATASETS[self.dataset]
        for key in ("domains", "heldout_domains"):
            for name in getattr(self.data, key) or ():
                if name not in known:
                    raise ValueError(
                        f"{_named(info, 'data', key)}: {self.dataset} has no domain {name!r}; "
                        f"its domains: {', '.join(known)}"
                    )
        used = self.data.domains or known
        key = _named(info, "data", "heldout_domains")
        for name in self.data.heldout_domains:
            if name not in used:
                raise ValueError(f"{key}: {name!r} is not among the domains read ({', '.join(used)})")
        if set(self.data.heldout_domains) >= set(used):
            raise ValueError(f"{key} holds every domain read ({', '.join(used)}): no client would train")
        return self

    @model_validator(mode="after")
    def _dataset_needs(self) -> BaseConfig:
        if self.dataset in FILE_DATASETS and not self.data_dir:
            hint = (
                ""
                if self.dataset in NATURAL_DATASETS and self.dataset != "domainnet"
                else f" (`pflkit download {self.dataset} DIR` fetches them where a network exists)"
            )
            raise ValueError(
                f"dataset {self.dataset!r} needs data_dir: a folder with {FILE_DATASETS[self.dataset]}{hint}"
            )
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
        """The model for samples of ``input_shape``: pfllib + auto picks fedavg_cnn (images) or fasttext
        (ids), leaf + auto fedavg_cnn (images) or mclr (feature vectors)."""
        if self.model == "auto" and self.dataset in ("pfllib", "leaf"):
            if len(input_shape) == 3:
                return "fedavg_cnn"
            return "fasttext" if self.dataset == "pfllib" else "mclr"
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
        _MODELS[key] = create_model("ExperimentConfig", __base__=BaseConfig, **fields)
    return _MODELS[key]

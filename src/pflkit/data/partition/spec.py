"""The partition spec and what the partitioners share.

:class:`PartitionSpec` holds the partition keys of the experiment config and :class:`ClientSplit`
what :func:`pflkit.data.partition.split_clients` returns. Every partitioner takes its randomness
from an explicit generator so that the partition seed stays separate from model and sampling
seeds. Two random conventions exist (``PartitionSpec.rng``): ``"pflkit"`` draws from a
``np.random.Generator`` keyed by the partition seed; ``"pfllib"`` draws from one legacy
``np.random.RandomState(seed)`` in exactly the order of PFLlib's generator scripts
(``np.random.seed(seed)``, then ``separate_data`` and ``split_data``), so a PFLlib split is
reproduced sample for sample from its seed.

Also here, as several families use them: the checks of the labels and the client count,
PFLlib's default minimum client size, the largest-remainder rule and per-client class counts.
The partitioners' parameters carry the names of the config keys, so their messages read as
advice to the user of ``pflkit run``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pflkit.data.errors import PartitionError

__all__ = [
    "PARTITION_METHODS",
    "PARTITION_RNGS",
    "ClientSplit",
    "PartitionError",
    "PartitionMethod",
    "PartitionRng",
    "PartitionSpec",
    "Rng",
    "TestSet",
    "class_counts",
    "largest_remainder",
    "pfllib_least_samples",
    "smallest_client",
]

PartitionMethod = Literal["iid", "dirichlet", "pathological", "kfold", "label_dirichlet", "shards", "exdir", "matrix"]
PartitionRng = Literal["pflkit", "pfllib"]
Quantity = Literal["partition", "lognormal", "linear", "given"]
TestSet = Literal["client_split", "official"]
PARTITION_METHODS: tuple[str, ...] = get_args(PartitionMethod)
PARTITION_RNGS: tuple[str, ...] = get_args(PartitionRng)
Rng = np.random.Generator | np.random.RandomState


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise PartitionError(f"labels must be a non-empty 1-d array, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise PartitionError(f"labels must be integers, got dtype {labels.dtype}")
    if labels.min() < 0:
        raise PartitionError(f"labels must be non-negative class ids, found {int(labels.min())}")
    return labels.astype(np.int64, copy=False)


def _check_num_clients(num_clients: int) -> None:
    if num_clients < 1:
        raise PartitionError(f"num_clients must be >= 1, got {num_clients}")


def _sorted(parts: list[np.ndarray] | list[list[int]]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def smallest_client(train_fraction: float, batch_size: int = 1) -> int:
    """The fewest samples for which the per-client split leaves ``batch_size`` training samples
    (floor(train_fraction * n)) and at least one test sample."""
    if not 0 < train_fraction < 1:
        return max(1, batch_size)
    # start just below the answer (floor(f * n) >= b needs n >= b / f): a few steps, whatever the batch size
    n = max(2, batch_size, math.floor(batch_size / train_fraction) - 2)
    while math.floor(train_fraction * n) < batch_size or n - math.floor(train_fraction * n) < 1:
        n += 1
    return n


def pfllib_least_samples(num_samples: int, num_clients: int, batch_size: int, train_fraction: float) -> int:
    """PFLlib's ``least_samples = int(min(batch_size / (1 - train_ratio), |D| / N / 2))``: one test
    batch per client (40 for batch 10 and a 75/25 split) unless the data is too small for it."""
    per_test_batch = batch_size / (1 - train_fraction) if train_fraction < 1 else float(batch_size)
    return int(min(per_test_batch, num_samples / num_clients / 2))


def largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total`` in proportion to ``shares`` (largest remainder rule;
    ties go to the lower index)."""
    shares = np.asarray(shares, dtype=np.float64)
    exact = shares / shares.sum() * total
    counts = np.floor(exact).astype(np.int64)
    remainder = exact - counts
    order = sorted(range(len(shares)), key=lambda i: (-remainder[i], i))
    counts[order[: total - int(counts.sum())]] += 1
    return counts


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-client label histogram, int64 of shape ``[num_clients, num_classes]``."""
    labels = np.asarray(labels)
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for i, part in enumerate(parts):
        client_labels = labels[np.asarray(part, dtype=np.int64)]
        if client_labels.size and (client_labels.min() < 0 or client_labels.max() >= num_classes):
            raise ValueError(f"class_counts: client {i} has labels outside 0..{num_classes - 1}")
        counts[i] = np.bincount(client_labels, minlength=num_classes)
    return counts


@dataclass
class _Draw:
    """A partitioner's parts in draw order (the pfllib split convention depends on it), the number
    of draws it took, the client minimum it holds to (``min_samples_per_client`` in the record) and,
    where it settled for less than asked, why."""

    parts: list[list[int]] | list[np.ndarray]
    tries: int
    minimum: int
    note: str = ""


class PartitionSpec(BaseModel):
    """How to split a pool over clients: the ``[partition]`` section of the experiment config
    (its flat keys ``partition``, ``partition_rng``, ``partition_seed``, ``num_clients``, ...
    are aliases of these fields, see ``pflkit.config.FLAT_KEYS``).

    The training batch size, which PFLlib's default minimum reads, is the run's ``[train]``
    setting: it is given where the partition is drawn (:func:`split_clients`), not kept here."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    method: PartitionMethod = Field(
        "dirichlet",
        description="iid; dirichlet (class-wise, PFLlib); pathological; "
        "kfold (SosicFL's k-Fold groups); label_dirichlet (client-wise Dir over label "
        "distributions with equal client sizes, SosicFL); shards (FedAvg's label-sorted shards); "
        "exdir (PFLlib's: classes_per_client classes per client, then Dirichlet among each class's "
        "holders); matrix (the client x class counts of class_matrix)",
    )
    num_clients: int = Field(20, ge=1, description="clients the data is split over")
    alpha: float = Field(0.1, gt=0, description="Dirichlet concentration")
    classes_per_client: int = Field(2, ge=1, description="pathological and exdir: classes per client")
    balanced: bool = Field(False, description="pathological: equal shares instead of PFLlib's random sizes")
    min_samples_per_client: int | None = Field(
        None,
        ge=0,
        description="dirichlet/pathological minimum samples per client (exdir: default PFLlib's 10; "
        "quantity: the least size it deals); default PFLlib's "
        "int(min(batch_size / (1 - train_fraction), samples / num_clients / 2)), lowered with a logged "
        "warning to one training batch + one test sample where no draw reaches it",
    )
    balance_cap: bool = Field(
        True,
        description="dirichlet and exdir: stop feeding clients that hold the average share "
        "(PFLlib; FedACD's paper leaves it open for its splits)",
    )
    train_fraction: float = Field(
        0.75,
        gt=0,
        lt=1,
        description="per-client train share (test_set = client_split; also sizes the default minimum of "
        "dirichlet/pathological)",
    )
    rng: PartitionRng = Field(
        "pflkit",
        description="random convention of the partition: pflkit's seeded streams, or PFLlib's "
        "np.random.seed(partition seed) order, which reproduces PFLlib's generated split of the same pool",
    )
    seed: int | None = Field(None, description="seed of the partition; default: each run seed")
    max_retries: int = Field(
        1000,
        ge=1,
        le=100_000,
        description="dirichlet and exdir: draws tried for the minimum client "
        "size (at most 100000: a minimum that many draws miss is out of reach)",
    )
    num_folds: int = Field(2, ge=1, description="kfold: G groups of clients and of primary classes")
    primary_fraction: float = Field(
        0.8,
        gt=0,
        le=1,
        description="kfold: share of a client's samples from its "
        "group's primary classes (the rest spread evenly over the others)",
    )
    test_set: TestSet = Field(
        "client_split",
        description="client_split: every client's samples split train/test (FedALA); "
        "official: the official training split is partitioned, the official test split is the global test "
        "set and each client gets a local test set with its label proportions",
    )
    shards_per_client: int = Field(
        2, ge=1, description="shards: shards per client (the pool sorted by label is cut into num_clients x this many)"
    )
    class_matrix: list[list[int]] | list[list[float]] | None = Field(
        None,
        description="matrix: one row per client, one column per class; whole numbers are sample counts, "
        "fractions the share of the class's samples the client gets (a column sums to at most 1)",
    )
    quantity: Quantity = Field(
        "partition",
        description="client sizes: partition (as the label partition gives them); lognormal (weights "
        "exp(quantity_sigma x N(0, 1))); linear (client i weighs i + 1); given (client_sizes). Sizes are "
        "dealt first (at least min_samples_per_client each), then each client is filled to its size with "
        "its label partition's class mix",
    )
    quantity_sigma: float = Field(1.0, gt=0, description="quantity = lognormal: sigma of the log sizes")
    client_sizes: list[int] | list[float] | None = Field(
        None,
        description="quantity = given: one size per client, in samples (whole numbers) or as fractions "
        "of the partitioned samples (summing to at most 1)",
    )
    iid_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of each client's samples drawn IID (the pool's class proportions) instead "
        "of from its label partition",
    )

    @model_validator(mode="after")
    def _axes_are_consistent(self) -> PartitionSpec:
        _check_axes(self)
        return self

    @property
    def official(self) -> bool:
        return self.test_set == "official"

    def seed_for(self, run_seed: int) -> int:
        """The partition seed of run seed ``run_seed`` (``seed`` fixes it across run seeds)."""
        return run_seed if self.seed is None else self.seed

    def generator(self, seed: int) -> Rng:
        """The partition's random source for ``seed`` (see the module docstring)."""
        if self.rng == "pfllib":
            return np.random.RandomState(seed)
        from pflkit.functional.streams import numpy_generator

        return numpy_generator(seed, "partition")


def _check_axes(spec: PartitionSpec) -> None:
    """The matrix and the given sizes: set exactly where read, one entry per client, none negative."""
    n = spec.num_clients
    if (spec.method == "matrix") != (spec.class_matrix is not None):
        raise ValueError('class_matrix is read by partition = "matrix" and needed there: set both or neither')
    if spec.class_matrix is not None:
        rows = {len(row) for row in spec.class_matrix}
        if len(spec.class_matrix) != n or len(rows) != 1 or 0 in rows:
            raise ValueError(
                f"class_matrix must have num_clients = {n} rows of one length (one column per class), "
                f"got {len(spec.class_matrix)} rows of lengths {sorted(rows)}"
            )
        if any(v < 0 for row in spec.class_matrix for v in row):
            raise ValueError("class_matrix holds a negative entry: counts and shares are >= 0")
    if (spec.quantity == "given") != (spec.client_sizes is not None):
        raise ValueError('client_sizes is read by quantity = "given" and needed there: set both or neither')
    if spec.client_sizes is not None:
        if len(spec.client_sizes) != n:
            raise ValueError(
                f"client_sizes has {len(spec.client_sizes)} entries, num_clients = {n}: give one per client"
            )
        if min(spec.client_sizes) < 0:
            raise ValueError(f"client_sizes holds a negative size ({min(spec.client_sizes)})")
        if isinstance(spec.client_sizes[0], float) and sum(spec.client_sizes) > 1 + 1e-9:
            raise ValueError(
                f"client_sizes are fractions summing to {sum(spec.client_sizes):g} > 1; write whole numbers "
                "for sample counts"
            )


@dataclass
class ClientSplit:
    """Per-client training and test indices into the pool, and how they were obtained."""

    train: list[np.ndarray]
    test: list[np.ndarray]
    info: dict[str, Any] = field(default_factory=dict)

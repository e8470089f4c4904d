"""The partition spec and what the partitioners share (spec §5.2-§5.6, §5.8).

:class:`PartitionSpec` holds the partition keys of the experiment config and :class:`ClientSplit`
what :func:`pflkit.data.partition.split_clients` returns. Every partitioner takes its randomness
from an explicit generator so that the partition seed stays separate from model and sampling
seeds (§5.8). Two random conventions exist (``PartitionSpec.rng``): ``"pflkit"`` draws from a
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
from typing import Any

import numpy as np

from pflkit.data.errors import PartitionError

__all__ = [
    "PARTITION_METHODS",
    "PARTITION_RNGS",
    "ClientSplit",
    "PartitionError",
    "PartitionSpec",
    "Rng",
    "class_counts",
    "largest_remainder",
    "pfllib_least_samples",
    "smallest_client",
]

PARTITION_METHODS: tuple[str, ...] = ("iid", "dirichlet", "pathological", "kfold", "label_dirichlet")
PARTITION_RNGS: tuple[str, ...] = ("pflkit", "pfllib")
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
    n = max(2, batch_size)
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
    counts[order[:total - int(counts.sum())]] += 1
    return counts


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-client label histogram, int64 of shape ``[num_clients, num_classes]``."""
    labels = np.asarray(labels)
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for i, part in enumerate(parts):
        client_labels = labels[np.asarray(part, dtype=np.int64)]
        if client_labels.size and (client_labels.min() < 0 or client_labels.max() >= num_classes):
            raise ValueError(
                f"class_counts: client {i} has labels outside 0..{num_classes - 1}"
            )
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


@dataclass(frozen=True)
class PartitionSpec:
    """How to split a pool over clients: the partition keys of the experiment config."""

    method: str = "dirichlet"
    num_clients: int = 20
    alpha: float = 0.1
    classes_per_client: int = 2
    balanced: bool = False
    min_samples_per_client: int | None = None
    balance_cap: bool = True
    train_fraction: float = 0.75
    batch_size: int = 10
    rng: str = "pflkit"
    max_retries: int = 1000
    num_folds: int = 2
    primary_fraction: float = 0.8
    test_set: str = "client_split"  # "official": clients get training data only (no per-client split)

    @property
    def official(self) -> bool:
        return self.test_set == "official"

    def generator(self, seed: int) -> Rng:
        """The partition's random source for ``seed`` (see the module docstring)."""
        if self.rng == "pfllib":
            return np.random.RandomState(seed)
        from pflkit.functional.streams import numpy_generator

        return numpy_generator(seed, "partition")


@dataclass
class ClientSplit:
    """Per-client training and test indices into the pool, and how they were obtained."""

    train: list[np.ndarray]
    test: list[np.ndarray]
    info: dict[str, Any] = field(default_factory=dict)

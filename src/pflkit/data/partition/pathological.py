"""Pathological label skew, PFLlib's ``'pat'`` rule: every client holds
``classes_per_client`` classes, dealt in order, each class cut into chunks of equal or random size.

Also PFLlib's IID split (``rng = "pfllib"``): this rule with every class.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from .spec import PartitionError, Rng, _check_labels, _check_num_clients, _sorted, pfllib_least_samples

__all__ = ["partition_pathological"]


def _integers(rng: Rng, low: int, high: int, size: int) -> list[int]:
    if isinstance(rng, np.random.RandomState):
        return rng.randint(low, high, size).tolist()
    return rng.integers(low, high, size=size).tolist()


def partition_pathological(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: Rng,
    *,
    balanced: bool = False,
    min_samples_per_client: int | None = None,
    batch_size: int = 10,
    train_fraction: float = 0.75,
    convention: Literal["pflkit", "pfllib"] = "pflkit",
) -> list[np.ndarray]:
    """Pathological label skew (PFLlib ``'pat'``); see :func:`_pathological`."""
    return _sorted(
        _pathological(
            labels,
            num_clients,
            classes_per_client,
            rng,
            balanced=balanced,
            min_samples_per_client=min_samples_per_client,
            batch_size=batch_size,
            train_fraction=train_fraction,
            convention=convention,
        )
    )


def _pathological(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: Rng,
    *,
    balanced: bool,
    min_samples_per_client: int | None,
    batch_size: int,
    train_fraction: float,
    convention: str,
) -> list[list[int]]:
    """Classes are dealt in order to the first ``N / C * n`` clients that still have quota, so
    groups of clients share the same classes (MNIST, N=20, n=2: 5 groups of 4). Each class's
    samples are cut into consecutive chunks: equal sizes if ``balanced``, otherwise random sizes in
    ``[max(m/10, least/C), m)`` with ``m`` the mean chunk size and ``least`` PFLlib's
    ``least_samples`` (or ``min_samples_per_client``); the last client takes the remainder.

    ``convention="pflkit"`` rounds ``N / C * n`` down (the FedALA-era PFLlib) and shuffles each
    class first; ``"pfllib"`` is today's PFLlib: rounded up, each class in pool order.
    """
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    num_classes = int(labels.max()) + 1
    if not 1 <= classes_per_client <= num_classes:
        raise PartitionError(
            f"pathological partition: classes_per_client={classes_per_client} must be in "
            f"1..{num_classes} (the labels hold {num_classes} classes)"
        )
    share = num_clients / num_classes * classes_per_client
    per_class = math.ceil(share) if convention == "pfllib" else int(share)
    if per_class < 1:
        raise PartitionError(
            f"pathological partition: num_clients={num_clients} x classes_per_client="
            f"{classes_per_client} / {num_classes} classes < 1 client per class; "
            "raise num_clients or classes_per_client"
        )
    least = (
        pfllib_least_samples(len(labels), num_clients, batch_size, train_fraction)
        if min_samples_per_client is None
        else min_samples_per_client
    )

    quota = np.full(num_clients, classes_per_client)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        selected = np.flatnonzero(quota > 0)[:per_class]
        if len(selected) == 0:
            break
        idx = np.flatnonzero(labels == c)
        if convention == "pflkit":
            idx = rng.permutation(idx)
        mean = len(idx) / len(selected)
        low, high = int(max(mean / 10, least / num_classes)), int(mean)
        if balanced or low >= high:
            # PFLlib's randint would raise for an empty range; a small class is
            # then split evenly instead.
            sizes = [int(mean)] * (len(selected) - 1)
        else:
            sizes = _integers(rng, low, high, len(selected) - 1)
        sizes.append(len(idx) - sum(sizes))
        start = 0
        for client, size in zip(selected, sizes):
            parts[client].extend(idx[start : start + size].tolist())
            start += size
            quota[client] -= 1

    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise PartitionError(
            f"pathological partition: clients {empty} got no data with num_clients={num_clients}, "
            f"classes_per_client={classes_per_client} and {num_classes} classes: each class goes to "
            f"{per_class} clients, which covers only {per_class * num_classes} of the "
            f"{num_clients * classes_per_client} client-class slots; choose num_clients x "
            "classes_per_client as a multiple of the number of classes"
        )
    return parts

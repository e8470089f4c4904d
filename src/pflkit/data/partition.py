"""Splitting a labelled pool among clients (spec §5.2, §5.4, §5.5).

Every function takes its randomness from an explicit ``np.random.Generator`` so
that the partition seed stays separate from model and sampling seeds (§5.8),
and returns one sorted int64 index array per client; the arrays are disjoint.
"""

from __future__ import annotations

import math

import numpy as np

from pflkit.data.errors import PartitionError

__all__ = [
    "PARTITION_METHODS",
    "class_counts",
    "partition",
    "partition_dirichlet",
    "partition_iid",
    "partition_pathological",
    "split_train_test",
]

PARTITION_METHODS: tuple[str, ...] = ("iid", "dirichlet", "pathological")

# PFLlib's least_samples: batch size 10 / test share 0.25 (one batch of test data per client).
_PFLLIB_LEAST = 40


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


def _finish(parts: list[np.ndarray] | list[list[int]]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def partition_iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle all samples and split them into ``num_clients`` near-equal parts."""
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    if num_clients > len(labels):
        raise PartitionError(
            f"iid partition: num_clients={num_clients} exceeds the {len(labels)} samples; "
            "some clients would get no data"
        )
    return _finish(np.array_split(rng.permutation(len(labels)), num_clients))


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    min_samples: int | None = None,
    balance_cap: bool = True,
    max_retries: int = 1000,
) -> list[np.ndarray]:
    """Class-wise Dirichlet split (PFLlib ``'dir'``, spec §5.4).

    For each class, proportions ``q ~ Dir(alpha)`` over clients decide how its
    shuffled samples are cut. With ``balance_cap`` clients already holding at
    least the average share get no more. The whole draw is repeated until the
    smallest client has ``min_samples`` samples (default
    ``min(40, n // num_clients // 2)``, PFLlib's ``least_samples``), at most
    ``max_retries`` times.
    """
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    n = len(labels)
    if not alpha > 0:
        raise PartitionError(f"dirichlet partition: alpha must be > 0, got {alpha}")
    if min_samples is None:
        min_samples = min(_PFLLIB_LEAST, n // num_clients // 2)
    if min_samples < 0:
        raise PartitionError(f"dirichlet partition: min_samples must be >= 0, got {min_samples}")
    if num_clients * min_samples > n:
        raise PartitionError(
            f"dirichlet partition: num_clients={num_clients} x min_samples={min_samples} = "
            f"{num_clients * min_samples} exceeds the {n} samples available"
        )
    if max_retries < 1:
        raise PartitionError(f"dirichlet partition: max_retries must be >= 1, got {max_retries}")

    class_indices = [np.flatnonzero(labels == c) for c in range(int(labels.max()) + 1)]
    average = n / num_clients
    best_smallest = 0
    for _ in range(max_retries):
        buckets: list[list[int]] = [[] for _ in range(num_clients)]
        for idx in class_indices:
            idx = rng.permutation(idx)
            q = rng.dirichlet(np.full(num_clients, alpha))
            if balance_cap:
                open_clients = np.array([len(b) < average for b in buckets])
                capped = q * open_clients
                # If every client is at or above the average (or all remaining mass
                # was on capped clients), PFLlib would divide by zero; we keep the
                # uncapped proportions for this class instead.
                if capped.sum() > 0:
                    q = capped
            q = q / q.sum()
            cuts = (np.cumsum(q) * len(idx)).astype(np.int64)[:-1]
            for bucket, piece in zip(buckets, np.split(idx, cuts)):
                bucket.extend(piece.tolist())
        smallest = min(len(b) for b in buckets)
        if smallest >= min_samples:
            return _finish(buckets)
        best_smallest = max(best_smallest, smallest)
    raise PartitionError(
        f"dirichlet partition: after {max_retries} tries with num_clients={num_clients}, "
        f"alpha={alpha}, min_samples={min_samples}, the smallest client reached at best "
        f"{best_smallest} samples; use fewer clients, a larger alpha or a smaller min_samples"
    )


def partition_pathological(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
    *,
    balanced: bool = False,
    min_samples: int | None = None,
) -> list[np.ndarray]:
    """Pathological label skew (PFLlib ``'pat'``, spec §5.2).

    Classes are dealt in order to the first ``int(N / C * n)`` clients that still
    have quota, so groups of clients share the same classes (MNIST, N=20, n=2:
    5 groups of 4). Each class's shuffled samples are cut into consecutive
    chunks: equal sizes if ``balanced``, otherwise random sizes in
    ``[max(m/10, min_samples/C), m)`` with ``m`` the mean chunk size (PFLlib's
    ``least_samples``, default 40); the last client takes the remainder.
    """
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    num_classes = int(labels.max()) + 1
    if not 1 <= classes_per_client <= num_classes:
        raise PartitionError(
            f"pathological partition: classes_per_client={classes_per_client} must be in "
            f"1..{num_classes} (the labels hold {num_classes} classes)"
        )
    clients_per_class = int(num_clients / num_classes * classes_per_client)
    if clients_per_class < 1:
        raise PartitionError(
            f"pathological partition: num_clients={num_clients} x classes_per_client="
            f"{classes_per_client} / num_classes={num_classes} < 1 client per class; "
            "use more clients or more classes per client"
        )
    least = _PFLLIB_LEAST if min_samples is None else min_samples

    quota = np.full(num_clients, classes_per_client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        selected = np.flatnonzero(quota > 0)[:clients_per_class]
        if len(selected) == 0:
            break
        idx = rng.permutation(np.flatnonzero(labels == c))
        mean = len(idx) / len(selected)
        low, high = int(max(mean / 10, least / num_classes)), int(mean)
        if balanced or low >= high:
            # PFLlib's randint would raise for an empty range; a small class is
            # then split evenly instead.
            sizes = [int(mean)] * (len(selected) - 1)
        else:
            sizes = rng.integers(low, high, size=len(selected) - 1).tolist()
        sizes.append(len(idx) - sum(sizes))
        start = 0
        for client, size in zip(selected, sizes):
            parts[client].append(idx[start : start + size])
            start += size
            quota[client] -= 1

    result = [np.sort(np.concatenate(p)) if p else np.empty(0, dtype=np.int64) for p in parts]
    empty = [i for i, p in enumerate(result) if len(p) == 0]
    if empty:
        raise PartitionError(
            f"pathological partition: clients {empty} got no data with num_clients={num_clients}, "
            f"classes_per_client={classes_per_client}, num_classes={num_classes}: each class goes to "
            f"{clients_per_class} clients, which covers only {clients_per_class * num_classes} of the "
            f"{num_clients * classes_per_client} client-class slots; choose num_clients * "
            "classes_per_client as a multiple of num_classes"
        )
    return _finish(result)


def split_train_test(
    parts: list[np.ndarray], train_fraction: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split each client's indices into train/test (spec §5.5, FedALA uses 0.75).

    Each client's samples are shuffled and the first ``floor(train_fraction * n)``
    become training data (as sklearn's ``train_test_split(train_size=...)``).
    Both outputs are sorted so they do not depend on the shuffle order.
    """
    if not 0 < train_fraction <= 1:
        raise PartitionError(f"train_fraction must be in (0, 1], got {train_fraction}")
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for i, part in enumerate(parts):
        part = np.asarray(part, dtype=np.int64)
        n_train = math.floor(train_fraction * len(part))
        if n_train == 0:
            raise PartitionError(
                f"split_train_test: client {i} has {len(part)} samples, so train_fraction="
                f"{train_fraction} leaves it no training data"
            )
        shuffled = rng.permutation(part)
        train.append(np.sort(shuffled[:n_train]))
        test.append(np.sort(shuffled[n_train:]))
    return train, test


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


def partition(
    labels: np.ndarray,
    *,
    method: str,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float = 0.1,
    classes_per_client: int = 2,
    balanced: bool = False,
    min_samples: int | None = None,
) -> list[np.ndarray]:
    """Dispatch to the partition ``method`` (one of :data:`PARTITION_METHODS`)."""
    if method == "iid":
        return partition_iid(labels, num_clients, rng)
    if method == "dirichlet":
        return partition_dirichlet(labels, num_clients, alpha, rng, min_samples=min_samples)
    if method == "pathological":
        return partition_pathological(
            labels, num_clients, classes_per_client, rng, balanced=balanced, min_samples=min_samples
        )
    raise ValueError(f"unknown partition method {method!r}; available: {', '.join(PARTITION_METHODS)}")

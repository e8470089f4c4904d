"""Client x class count matrices: a user's ``class_matrix`` turned into counts, a target matrix fitted
to the samples the pool holds, and the clients' samples drawn to match a count matrix.

The other axes (:mod:`.quantity`: client sizes, an IID share) end here too: they change a
partition's count matrix, and :func:`fill` draws the clients' samples for it.
"""

from __future__ import annotations

import numpy as np

from .spec import PartitionError, Rng, largest_remainder

__all__ = ["deal", "fill", "fit_columns", "matrix_counts"]


def deal(shares: np.ndarray, total: int) -> np.ndarray:
    """:func:`largest_remainder`, and zeros where there is nothing to deal (or no share to deal it by)."""
    shares = np.asarray(shares, dtype=np.float64)
    if total <= 0 or shares.sum() <= 0:
        return np.zeros(len(shares), dtype=np.int64)
    return largest_remainder(shares, int(total))


def matrix_counts(matrix: list[list[int]] | list[list[float]], labels: np.ndarray) -> np.ndarray:
    """``class_matrix`` as counts: whole numbers as they are, fractions of each class's samples by the
    largest remainder rule (a column summing to 1 hands out the whole class). Refused, in one line,
    where its shape does not fit the labels or it asks for more samples of a class than there are."""
    available = np.bincount(labels)
    values = np.asarray(matrix, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] != len(available):
        raise PartitionError(
            f"class_matrix has {values.shape[-1]} columns, but the labels hold {len(available)} classes: give one "
            "column per class"
        )
    if all(isinstance(v, int) for row in matrix for v in row):
        counts = values.astype(np.int64)
        over = np.flatnonzero(counts.sum(0) > available)
        if len(over):
            k = int(over[0])
            raise PartitionError(
                f"class_matrix asks for {int(counts[:, k].sum())} samples of class {k}, but the pool holds "
                f"{int(available[k])}"
            )
    else:
        shares = values.sum(0)
        over = np.flatnonzero(shares > 1 + 1e-9)
        if len(over):
            k = int(over[0])
            raise PartitionError(
                f"class_matrix gives away {shares[k]:g} of class {k}'s samples: a column of fractions sums to at most 1"
            )
        counts = np.stack(
            [deal(values[:, k], round(min(shares[k], 1.0) * available[k])) for k in range(len(available))], 1
        )
    empty = np.flatnonzero(counts.sum(1) == 0)
    if len(empty):
        raise PartitionError(f"class_matrix gives clients {empty[:10].tolist()} no sample: every row needs one")
    return counts


def fit_columns(targets: np.ndarray, available: np.ndarray) -> np.ndarray:
    """``targets`` (clients x classes) with every client's total kept and no class asked for more than
    ``available``: an over-asked class is cut among its clients in proportion, and each client's
    shortfall is taken from its own classes that have samples left (in its targets' proportions),
    then from any class with samples left."""
    t = np.asarray(targets, dtype=np.int64).copy()
    rows = t.sum(1)
    if rows.sum() > available.sum():
        raise PartitionError(
            f"the clients ask for {int(rows.sum())} samples, but the pool holds {int(available.sum())}"
        )
    for k in np.flatnonzero(t.sum(0) > available):
        t[:, k] = deal(t[:, k], int(available[k]))
    weights = np.asarray(targets, dtype=np.float64)
    left = available - t.sum(0)
    deficit = rows - t.sum(1)
    while deficit.any():
        for i in np.flatnonzero(deficit):
            w = np.where(left > 0, weights[i], 0.0)
            if w.sum() <= 0:
                w = left.astype(np.float64)
            add = np.minimum(deal(w, int(deficit[i])), left)  # at least one sample: w > 0 only where left > 0
            t[i] += add
            left -= add
            deficit[i] -= add.sum()
    return t


def fill(labels: np.ndarray, counts: np.ndarray, rng: Rng, parts: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Each client's samples, ``counts[i, k]`` of class k for client i (each column at most the
    class's samples), disjoint, sorted. Where ``parts`` is given a client keeps a random subset of
    its own samples of a class, up to its count, and the rest comes at random from the class's
    samples that no client keeps."""
    num_clients, num_classes = counts.shape
    owner = np.full(len(labels), -1, dtype=np.int64)
    for i, part in enumerate(parts or []):
        owner[np.asarray(part, dtype=np.int64)] = i
    chosen: list[np.ndarray] = []
    clients: list[np.ndarray] = []
    for k in range(num_classes):
        idx = rng.permutation(np.flatnonzero(labels == k))
        own = owner[idx]
        order = np.argsort(own, kind="stable")
        idx, own = idx[order], own[order]
        holder = np.maximum(own, 0)
        rank = np.arange(len(idx)) - np.searchsorted(own, np.arange(num_clients))[holder]
        keep = (own >= 0) & (rank < counts[holder, k])
        need = counts[:, k] - np.bincount(own[keep], minlength=num_clients)
        free = rng.permutation(idx[~keep])
        if need.sum() > len(free):
            raise PartitionError(f"class {k}: the clients ask for more samples than the pool holds")
        chosen += [idx[keep], free[: need.sum()]]
        clients += [own[keep], np.repeat(np.arange(num_clients), need)]
    samples, owners = np.concatenate(chosen), np.concatenate(clients)
    order = np.lexsort((samples, owners))
    return np.split(samples[order], np.cumsum(np.bincount(owners, minlength=num_clients))[:-1])

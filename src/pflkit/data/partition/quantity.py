"""Quantity skew and an IID share, two axes on top of any label partition.

Both work on the partition's client x class count matrix and hand it to :func:`.matrix.fill`,
which keeps as many of each client's own samples as the new counts allow:

* quantity skew decides the client sizes first (``quantity``: ``lognormal``, ``linear`` or
  ``given``); each client then gets its size with its label partition's class mix, by the largest
  remainder rule; where a class runs short, its clients are cut in proportion and make up the
  difference from their other classes, then from any class with samples left. Sizes are exact;
  where they add up to all the partitioned samples, every one of them is used again.
* ``iid_share`` s: floor(s n_i) of client i's n_i samples follow the pool's class proportions
  instead of its partition's; its size stays n_i.
"""

from __future__ import annotations

import numpy as np

from .matrix import deal, fill, fit_columns
from .spec import PartitionError, PartitionSpec, Rng, pfllib_least_samples, smallest_client

__all__ = ["client_sizes", "mix_iid", "reshape", "resize"]


def reshape(
    labels: np.ndarray,
    counts: np.ndarray,
    parts: list[np.ndarray] | None,
    spec: PartitionSpec,
    rng: Rng,
    batch_size: int,
) -> list[np.ndarray]:
    """The clients' samples for the partition's ``counts`` (its ``parts``, if any, kept where they
    can be) after the quantity skew and the IID share of ``spec``."""
    available = np.bincount(labels, minlength=counts.shape[1])
    if spec.quantity != "partition":
        n, clients = len(labels), spec.num_clients
        viable = 1 if spec.official else smallest_client(spec.train_fraction)
        least = spec.min_samples_per_client
        if least is None:
            least = pfllib_least_samples(n, clients, batch_size, spec.train_fraction)
        sizes = client_sizes(spec, int(counts.sum()), n, rng, max(least, viable), viable)
        counts = resize(counts, sizes, available)
    if spec.iid_share > 0:
        counts = mix_iid(counts, spec.iid_share, available)
    return fill(labels, counts, rng, parts)


def client_sizes(spec: PartitionSpec, total: int, pool: int, rng: Rng, minimum: int, viable: int) -> np.ndarray:
    """Every client's size: ``minimum`` each, and the rest of the ``total`` partitioned samples in
    proportion to log-normal or linear weights; or ``client_sizes`` (counts, or fractions of
    ``total``), each at least ``viable`` and all within the ``pool``."""
    n = spec.num_clients
    if spec.quantity == "given":
        given = np.asarray(spec.client_sizes, dtype=np.float64)
        if spec.client_sizes and isinstance(spec.client_sizes[0], int):
            sizes = given.astype(np.int64)
        else:
            sizes = deal(given, round(min(given.sum(), 1.0) * total))
        if sizes.sum() > pool:
            raise PartitionError(f"client_sizes add up to {int(sizes.sum())} samples, but the pool holds {pool}")
        small = np.flatnonzero(sizes < viable)
        if len(small):
            raise PartitionError(
                f"client_sizes give client {int(small[0])} {int(sizes[small[0]])} samples; every client needs at "
                f"least {viable} (one to train and one to test at train_fraction={spec.train_fraction})"
                if viable > 1
                else f"client_sizes give client {int(small[0])} no sample; every client needs one"
            )
        return sizes
    if n * minimum > total:
        raise PartitionError(
            f"quantity = {spec.quantity!r}: num_clients={n} x {minimum} samples (the least size, "
            f"min_samples_per_client) exceeds the {total} partitioned samples; lower num_clients or "
            "min_samples_per_client"
        )
    if spec.quantity == "lognormal":
        weights = rng.lognormal(0.0, spec.quantity_sigma, n)
    else:
        weights = np.arange(1, n + 1, dtype=np.float64)
    return minimum + deal(weights, total - n * minimum)


def resize(counts: np.ndarray, sizes: np.ndarray, available: np.ndarray) -> np.ndarray:
    """The count matrix with client i of size ``sizes[i]`` and its row's class mix, fitted to ``available``."""
    targets = np.stack([deal(row, int(s)) if row.sum() else np.zeros_like(row) for row, s in zip(counts, sizes)])
    for i in np.flatnonzero(targets.sum(1) < sizes):  # a client with no class mix takes any class
        targets[i] += deal(available, int(sizes[i] - targets[i].sum()))
    return fit_columns(targets, available)


def mix_iid(counts: np.ndarray, share: float, available: np.ndarray) -> np.ndarray:
    """The count matrix with floor(share x n_i) of each client's n_i samples in the pool's class proportions."""
    rows = []
    for row in counts:
        size = int(row.sum())
        iid = int(np.floor(share * size + 1e-9))  # 0.29 x 100 is 28.999...
        rows.append(deal(row, size - iid) + deal(available, iid))
    return fit_columns(np.stack(rows), available)

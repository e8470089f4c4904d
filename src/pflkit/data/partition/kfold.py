"""SosicFL's partitions (SosicFL paper, Section 4.1, "Data heterogeneity"): k-Fold groups and the
client-wise label Dirichlet, with equal client sizes. The paper gives the groups' 80/20 shares and
phi_k ~ Dir(beta); the sizes and counts below are our reconstruction.

Both give every client the same number of samples, floor(N / K) (k-Fold: fewer for all where a
class runs short), drawn without replacement with class counts by the largest-remainder rule;
clients come in the order they were drawn.
"""

from __future__ import annotations

import logging

import numpy as np

from .spec import PartitionError, Rng, _check_labels, _check_num_clients, largest_remainder

__all__ = ["partition_kfold", "partition_label_dirichlet"]

log = logging.getLogger(__name__)


def partition_kfold(
    labels: np.ndarray, num_clients: int, num_folds: int, rng: Rng, *, primary_fraction: float = 0.8
) -> list[np.ndarray]:
    """SosicFL's k-Fold groups (after Huang et al. 2021; counts reconstructed): classes and clients
    are cut into ``num_folds`` groups; every client of group g holds n = floor(N / K) samples,
    ``primary_fraction`` of them spread evenly over g's primary classes and the rest evenly over the
    other classes, with the same largest-remainder counts for the whole group, so a group's clients
    have identical label distributions. Samples are drawn without replacement; where a class cannot
    feed every client n shrinks (logged). Clients are numbered group by group."""
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    num_classes = int(labels.max()) + 1
    if not 1 <= num_folds <= min(num_classes, num_clients):
        raise PartitionError(
            f"kfold partition: num_folds={num_folds} must be in 1..{min(num_classes, num_clients)} "
            f"(at most the {num_classes} classes and num_clients={num_clients})"
        )
    if not 0 < primary_fraction <= 1:
        raise PartitionError(f"kfold partition: primary_fraction must be in (0, 1], got {primary_fraction}")
    primaries = np.array_split(np.arange(num_classes), num_folds)
    groups = np.array_split(np.arange(num_clients), num_folds)
    available = np.bincount(labels, minlength=num_classes)

    def quotas(n: int) -> list[np.ndarray]:
        out = []
        for primary in primaries:
            shares = np.zeros(num_classes)
            others = num_classes - len(primary)
            shares[primary] = (primary_fraction if others else 1.0) / len(primary)
            if others:
                shares[np.setdiff1d(np.arange(num_classes), primary)] = (1 - primary_fraction) / others
            out.append(largest_remainder(shares, n))
        return out

    n = len(labels) // num_clients
    while n > 0:
        need = sum(len(g) * q for g, q in zip(groups, quotas(n)))
        if np.all(need <= available):
            break
        n -= 1
    if n == 0:
        raise PartitionError(
            f"kfold partition: the classes cannot give num_clients={num_clients} clients one "
            "sample each with these groups; lower num_clients or num_folds"
        )
    if n < len(labels) // num_clients:
        log.warning(
            "kfold partition: classes too small for %d samples per client; every client gets %d",
            len(labels) // num_clients,
            n,
        )
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
    parts: list[np.ndarray] = []
    for group, quota in zip(groups, quotas(n)):
        for _ in group:
            taken = []
            for c in np.flatnonzero(quota):
                taken += pools[c][: quota[c]]
                del pools[c][: quota[c]]
            parts.append(np.asarray(taken, dtype=np.int64))
    return parts


def partition_label_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, rng: Rng) -> list[np.ndarray]:
    """Client-wise Dirichlet over label distributions with equal client sizes (SosicFL paper,
    Section 4.1; sizes and counts reconstructed): phi_k ~ Dir(alpha 1_L), n = floor(N / K), class
    counts by largest remainder of n phi_k, drawn without replacement; a class pool that runs dry
    passes the client's deficit to its other classes in proportion to phi_k (to any class with
    samples left where those are dry)."""
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    if not alpha > 0:
        raise PartitionError(f"label_dirichlet partition: alpha must be > 0, got {alpha}")
    num_classes = int(labels.max()) + 1
    n = len(labels) // num_clients
    if n == 0:
        raise PartitionError(
            f"label_dirichlet partition: num_clients={num_clients} exceeds the {len(labels)} samples; lower num_clients"
        )
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
    parts = []
    for _ in range(num_clients):
        phi = rng.dirichlet(np.full(num_classes, alpha))
        want = largest_remainder(phi, n)
        taken: list[int] = []
        while True:
            left = np.array([len(p) for p in pools])
            got = np.minimum(want, left)
            for c in np.flatnonzero(got):
                taken += pools[c][: got[c]]
                del pools[c][: got[c]]
            deficit = int((want - got).sum())
            if deficit == 0:
                break
            left = np.array([len(p) for p in pools])
            weights = np.where(left > 0, phi, 0.0)
            if weights.sum() <= 0:
                weights = (left > 0).astype(np.float64)
            want = largest_remainder(weights, deficit)  # only classes with samples left: each pass takes some
        parts.append(np.asarray(taken, dtype=np.int64))
    return parts

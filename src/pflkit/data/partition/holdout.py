"""Clients' test data: the per-client train/test split of the client-split protocol,
the local test sets of the official-test-set protocol (docs/explanations/metrics.md), and the
fixed stratified split that stands in for an official split where a dataset ships none.
"""

from __future__ import annotations

import math

import numpy as np

from .spec import PartitionError, Rng, largest_remainder, smallest_client

__all__ = ["local_test_sets", "split_train_test", "stratified_test_split"]


def split_train_test(
    parts: list[np.ndarray], train_fraction: float, rng: Rng, *, convention: str = "pflkit"
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split each client's indices into train/test (FedALA uses 0.75: paper, "Experimental Setup").

    ``"pflkit"``: each client's samples are shuffled and the first ``floor(train_fraction * n)``
    become training data. ``"pfllib"``: scikit-learn's ``train_test_split(train_size=...,
    shuffle=True)`` on the client's samples in their given order with the ``RandomState``
    ``rng`` (test = the first ceil((1 - train_fraction) n) of the permutation), as PFLlib's
    ``split_data``. Both outputs are sorted.
    """
    if not 0 < train_fraction < 1:
        raise PartitionError(f"train_fraction must be in (0, 1), got {train_fraction}")
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for i, part in enumerate(parts):
        part = np.asarray(part, dtype=np.int64)
        n_train = math.floor(train_fraction * len(part))
        if n_train == 0 or n_train == len(part):
            need = smallest_client(train_fraction)
            raise PartitionError(
                f"client {i} got {len(part)} sample(s): too few to split into training and test data at "
                f"train_fraction={train_fraction} (a client needs at least {need}); set "
                "min_samples_per_client, lower num_clients or raise alpha"
            )
        if convention == "pfllib":
            from sklearn.model_selection import train_test_split

            if not isinstance(rng, np.random.RandomState):
                raise TypeError("the pfllib split convention draws from a np.random.RandomState")
            try:
                tr, te = train_test_split(part, train_size=train_fraction, shuffle=True, random_state=rng)
            except ValueError as exc:
                raise PartitionError(
                    f"client {i}: scikit-learn cannot split {len(part)} samples at "
                    f"train_fraction={train_fraction} ({exc})"
                ) from None
        else:
            shuffled = rng.permutation(part)
            tr, te = shuffled[:n_train], shuffled[n_train:]
        train.append(np.sort(tr))
        test.append(np.sort(te))
    return train, test


def local_test_sets(train_counts: np.ndarray, test_labels: np.ndarray, size: int, rng: Rng) -> list[np.ndarray]:
    """Per client, ``size`` positions of the test pool whose labels follow the client's training
    label proportions (largest remainder counts; reconstructed, as the SosicFL paper does not say
    how its local test sets are drawn). Within a client each class
    is drawn without replacement (with replacement where the pool holds fewer); clients may share
    test samples."""
    num_classes = train_counts.shape[1]
    pools = [np.flatnonzero(test_labels == c) for c in range(num_classes)]
    out = []
    for i, counts in enumerate(train_counts):
        quota = largest_remainder(counts, size)
        chosen = []
        for c in np.flatnonzero(quota):
            if len(pools[c]) == 0:
                raise PartitionError(
                    f"client {i} trains on class {c}, of which the official test split holds no "
                    "sample: no local test set can follow its label distribution"
                )
            chosen.append(rng.choice(pools[c], size=int(quota[c]), replace=bool(quota[c] > len(pools[c]))))
        out.append(np.sort(np.concatenate(chosen)) if chosen else np.empty(0, dtype=np.int64))
    return out


def stratified_test_split(
    labels: np.ndarray, test_fraction: float = 0.25, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A fixed stratified split (training rows, test rows) for datasets without an official one."""
    from sklearn.model_selection import train_test_split

    rows = np.arange(len(labels))
    train, test = train_test_split(rows, test_size=test_fraction, stratify=labels, random_state=seed)
    return np.sort(train), np.sort(test)

"""The one way from (labels, spec, seed) to clients' training and test indices:
:func:`split_clients`.

It draws the partition of ``spec.method`` from the partition seed's generator (:mod:`.iid`,
:mod:`.dirichlet`, :mod:`.pathological`, :mod:`.kfold`) and then the clients' test data
(:mod:`.holdout`), in one random stream, in this order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .dirichlet import _dirichlet
from .exdir import _exdir
from .holdout import local_test_sets, split_train_test
from .iid import partition_iid
from .kfold import partition_kfold, partition_label_dirichlet
from .matrix import matrix_counts
from .pathological import _pathological
from .quantity import reshape
from .shards import partition_shards
from .spec import (
    ClientSplit,
    PartitionError,
    PartitionSpec,
    Rng,
    _check_labels,
    _check_num_clients,
    _Draw,
    _sorted,
    class_counts,
    smallest_client,
)

__all__ = ["split_clients"]


def _draw(labels: np.ndarray, spec: PartitionSpec, rng: Rng, batch_size: int) -> _Draw:
    """The partition of ``spec.method`` (parts in draw order) after checking that the pool can give
    every client what the test-set protocol needs, then its quantity skew and IID share."""
    labels = _check_labels(labels)
    if spec.method == "matrix":
        _check_pool(labels, spec)
        assert spec.class_matrix is not None  # the spec's validator
        counts = matrix_counts(spec.class_matrix, labels)
        viable = 1 if spec.official else smallest_client(spec.train_fraction)
        if spec.quantity == "partition" and counts.sum(1).min() < viable:
            i = int(np.argmin(counts.sum(1)))
            raise PartitionError(
                f"class_matrix gives client {i} {int(counts[i].sum())} sample(s); every client needs at least "
                f"{viable} (one to train and one to test at train_fraction={spec.train_fraction})"
            )
        draw, own = _Draw([], 1, 0), None
    else:
        draw = _label_draw(labels, spec, rng, batch_size)
        if spec.quantity == "partition" and spec.iid_share == 0:
            return draw
        own = [np.asarray(p, dtype=np.int64) for p in draw.parts]
        counts = class_counts(labels, own, int(labels.max()) + 1)
    parts = reshape(labels, counts, own, spec, rng, batch_size)
    return _Draw(parts, draw.tries, min(len(p) for p in parts), draw.note)


def _check_pool(labels: np.ndarray, spec: PartitionSpec) -> None:
    """A clear error where the pool cannot give every client what the test-set protocol needs."""
    labels = _check_labels(labels)
    _check_num_clients(spec.num_clients)
    n = len(labels)
    viable = 1 if spec.official else smallest_client(spec.train_fraction)
    if spec.num_clients * viable > n:
        need = (
            "one training sample"
            if spec.official
            else f"{viable}: one to train and one to test at train_fraction={spec.train_fraction}"
        )
        raise PartitionError(
            f"num_clients={spec.num_clients} needs at least {spec.num_clients * viable} samples (every client "
            f"needs {need}), but the {'official training split' if spec.official else 'dataset'} holds {n}; "
            f"lower num_clients to at most {n // viable}"
        )


def _label_draw(labels: np.ndarray, spec: PartitionSpec, rng: Rng, batch_size: int) -> _Draw:
    """The label partition of ``spec.method``, parts in draw order."""
    _check_pool(labels, spec)
    if spec.method == "dirichlet":
        return _dirichlet(
            labels,
            spec.num_clients,
            spec.alpha,
            rng,
            min_samples_per_client=spec.min_samples_per_client,
            balance_cap=spec.balance_cap,
            max_retries=spec.max_retries,
            batch_size=batch_size,
            train_fraction=spec.train_fraction,
            official=spec.official,
        )
    pathological: dict[str, Any] = dict(
        balanced=spec.balanced,
        min_samples_per_client=spec.min_samples_per_client,
        batch_size=batch_size,
        train_fraction=spec.train_fraction,
        convention=spec.rng,
    )
    parts: list[list[int]] | list[np.ndarray]
    if spec.method == "iid" and spec.rng == "pfllib":  # PFLlib's iid is its pathological rule with every class
        parts = _pathological(labels, spec.num_clients, int(labels.max()) + 1, rng, **pathological)
    elif spec.method == "iid":
        parts = partition_iid(labels, spec.num_clients, rng)
    elif spec.method == "pathological":
        parts = _pathological(labels, spec.num_clients, spec.classes_per_client, rng, **pathological)
    elif spec.method == "kfold":
        parts = partition_kfold(labels, spec.num_clients, spec.num_folds, rng, primary_fraction=spec.primary_fraction)
    elif spec.method == "label_dirichlet":
        parts = partition_label_dirichlet(labels, spec.num_clients, spec.alpha, rng)
    elif spec.method == "shards":
        parts = partition_shards(labels, spec.num_clients, spec.shards_per_client, rng)
    elif spec.method == "exdir":
        return _exdir(
            labels,
            spec.num_clients,
            spec.classes_per_client,
            spec.alpha,
            rng,
            min_samples_per_client=spec.min_samples_per_client,
            balance_cap=spec.balance_cap,
            max_retries=spec.max_retries,
            train_fraction=spec.train_fraction,
            official=spec.official,
            convention=spec.rng,
        )
    else:
        raise AssertionError(f"unreachable: PartitionSpec admits no method {spec.method!r}")
    return _Draw(parts, 1, min(len(p) for p in parts))


def split_clients(
    labels: np.ndarray,
    spec: PartitionSpec,
    seed: int,
    pools: tuple[np.ndarray, np.ndarray] | None = None,
    *,
    batch_size: int = 10,
) -> ClientSplit:
    """Partition ``labels`` by ``spec`` with the partition seed ``seed`` (``spec.seed_for(run
    seed)``) and give every client its training and test indices; ``info`` records what was done.
    ``batch_size`` is the run's training batch size, which PFLlib's default minimum client size
    reads (``min_samples_per_client`` unset).

    ``client_split``: the whole pool is partitioned and every client's samples are split into
    training and test data. ``official``: ``pools`` = (official training rows,
    official test rows); only the training rows are partitioned (each client trains on its whole
    part) and each client's test data is a local test set drawn from the official test rows with
    its training label proportions (:func:`local_test_sets`).
    """
    rng = spec.generator(seed)
    if spec.official:
        if pools is None:
            raise ValueError("the official test-set protocol needs the official training and test rows")
        train_pool, test_pool = (np.asarray(p, dtype=np.int64) for p in pools)
        draw = _draw(labels[train_pool], spec, rng, batch_size)
        train = _sorted([train_pool[np.asarray(p, dtype=np.int64)] for p in draw.parts])
        empty = [i for i, t in enumerate(train) if len(t) == 0]
        if empty:
            raise PartitionError(
                f"clients {empty[:10]} got no training sample; set min_samples_per_client to "
                "at least 1, lower num_clients or raise alpha"
            )
        num_classes = int(labels.max()) + 1
        counts = class_counts(labels, train, num_classes)
        size = len(test_pool) // spec.num_clients
        test = [test_pool[t] for t in local_test_sets(counts, labels[test_pool], size, rng)]
        info: dict[str, Any] = {
            "method": spec.method,
            "rng": spec.rng,
            "partition_seed": seed,
            "tries": draw.tries,
            "min_samples_per_client": draw.minimum,
            "test_set": "official",
            "local_test_size": size,
            "global_test_size": len(test_pool),
        }
    else:
        draw = _draw(labels, spec, rng, batch_size)
        parts = [np.asarray(p, dtype=np.int64) for p in draw.parts]
        if spec.rng == "pflkit":
            parts = _sorted(parts)
        train, test = split_train_test(parts, spec.train_fraction, rng, convention=spec.rng)
        info = {
            "method": spec.method,
            "rng": spec.rng,
            "partition_seed": seed,
            "tries": draw.tries,
            "min_samples_per_client": draw.minimum,
            "test_set": "client_split",
        }
    if spec.quantity != "partition":
        info["quantity"] = spec.quantity
    if spec.iid_share > 0:
        info["iid_share"] = spec.iid_share
    if draw.note:
        info["fallback"] = draw.note
    return ClientSplit(train, test, info)

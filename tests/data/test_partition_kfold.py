"""SosicFL's partitions: k-Fold groups of identical label counts and the label Dirichlet of
equal-sized disjoint clients."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pflkit.data import PartitionError
from pflkit.data.partition.kfold import partition_kfold, partition_label_dirichlet


def test_kfold_clients_of_a_group_have_identical_counts() -> None:
    labels = np.repeat(np.arange(10), 5000)  # CIFAR-10's training split shape
    parts = partition_kfold(labels, 100, 2, np.random.default_rng(0))
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])
    assert np.all(counts[:50] == counts[0]) and np.all(counts[50:] == counts[50])
    assert counts[0].tolist() == [80] * 5 + [20] * 5 and counts[50].tolist() == [20] * 5 + [80] * 5  # SosicFL's 80/20
    assert len(np.unique(np.concatenate(parts))) == 50_000  # disjoint, the whole set
    with pytest.raises(PartitionError, match="num_folds=11"):
        partition_kfold(labels, 100, 11, np.random.default_rng(0))


def test_kfold_shrinks_clients_when_a_class_runs_dry(caplog: pytest.LogCaptureFixture) -> None:
    labels = np.concatenate([np.repeat(np.arange(10), 100), np.zeros(500, dtype=np.int64)])  # class 0 large
    with caplog.at_level(logging.WARNING):
        parts = partition_kfold(labels, 10, 2, np.random.default_rng(0))
    sizes = {len(p) for p in parts}
    assert len(sizes) == 1 and sizes.pop() < 150 and "every client gets" in caplog.text


def test_label_dirichlet_gives_equal_sizes_and_disjoint_clients() -> None:
    labels = np.repeat(np.arange(10), 600)
    parts = partition_label_dirichlet(labels, 100, 0.1, np.random.default_rng(0))
    assert {len(p) for p in parts} == {60}
    assert len(np.unique(np.concatenate(parts))) == 6000
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])
    assert (counts > 0).sum(1).mean() < 5  # concentrated label distributions

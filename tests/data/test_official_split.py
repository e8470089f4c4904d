"""The official protocol's data: the training split partitioned, local test sets drawn from the
test split by largest remainder, and a fixed stratified split for datasets without one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pflkit.data import Dataset, PartitionSpec
from pflkit.data.federated import FederatedData, official_split
from pflkit.data.partition.holdout import local_test_sets
from pflkit.data.partition.spec import largest_remainder


def pool(n_train: int = 600, n_test: int = 200, classes: int = 5) -> Dataset:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, classes, (n_train + n_test,), generator=g)
    x = torch.randn(n_train + n_test, 1, 8, 8, generator=g)
    return Dataset("toy", x, y, classes, official_train=n_train)


def test_official_protocol_partitions_the_training_split_and_draws_local_test_sets():
    data = pool()
    fed = FederatedData.build(
        data, PartitionSpec(num_clients=6, alpha=0.3, test_set="official", min_samples_per_client=10), seed=1
    )
    train_rows = np.concatenate([c.train_rows.numpy() for c in fed.clients])
    assert sorted(train_rows.tolist()) == list(range(600))  # the whole training split, disjoint
    assert torch.equal(fed.global_test_rows, torch.arange(600, 800))  # the official test split
    for client in fed.clients:
        assert client.num_test == 200 // 6 and (client.test_rows >= 600).all()  # drawn from the test split
        counts = np.bincount(client.train_y.numpy(), minlength=5)
        expected = largest_remainder(counts, 200 // 6)
        assert np.bincount(client.test_y.numpy(), minlength=5).tolist() == expected.tolist()
        assert len(set(client.test_rows.tolist())) == client.num_test  # no repeats within a client
    assert fed.partition_info["test_set"] == "official" and fed.partition_info["local_test_size"] == 33


def test_largest_remainder_and_local_test_sets_reuse_samples_across_clients():
    assert largest_remainder(np.array([3, 1, 0, 2]), 10).tolist() == [5, 2, 0, 3]
    assert largest_remainder(np.array([1, 1, 1]), 2).tolist() == [1, 1, 0]  # ties: lower index first
    test_labels = np.array([0] * 3 + [1] * 30)
    sets = local_test_sets(np.array([[10, 0], [10, 0]]), test_labels, 5, np.random.default_rng(0))
    assert all(len(s) == 5 and set(test_labels[s]) == {0} for s in sets)  # 5 from a pool of 3: with repeats
    with pytest.raises(Exception, match="holds no sample"):
        local_test_sets(np.array([[1, 1, 1]]), np.array([0, 1]), 4, np.random.default_rng(0))


def test_datasets_without_an_official_split_use_a_fixed_stratified_one():
    data = Dataset("toy", torch.randn(100, 1, 8, 8), torch.arange(100) % 4, 4)
    train, test = official_split(data)
    assert len(test) == 25 and sorted(np.bincount(data.y.numpy()[test]).tolist()) == [6, 6, 6, 7]
    again = official_split(data)
    assert np.array_equal(train, again[0]) and not set(train) & set(test)

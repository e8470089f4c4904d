"""partition_rng = "pfllib" reproduces PFLlib's generated split from its seed, sample for sample.

The reference below follows the logic of PFLlib's ``dataset/utils/dataset_utils.py``
(``separate_data`` for 'dir' and 'pat', then ``split_data``) as its generator scripts run it:
``np.random.seed(seed)`` once, every draw from numpy's global legacy generator, scikit-learn's
``train_test_split`` without a random_state (which also draws from the global generator).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.model_selection import train_test_split

from pflkit.data import PartitionSpec, load_dataset, split_clients
from tests.support.paths import SHARED_MNIST

BATCH, TRAIN_RATIO = 10, 0.75


def pfllib_reference(
    labels: np.ndarray, num_clients: int, partition: str, alpha: float, class_per_client: int, balance: bool, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        num_classes = len(set(labels.tolist()))
        least = int(min(BATCH / (1 - TRAIN_RATIO), len(labels) / num_clients / 2))
        client_idx: dict[int, np.ndarray | list[int]] = {}
        if partition == "pat":
            by_class = [np.arange(len(labels))[labels == c] for c in range(num_classes)]
            left = [class_per_client] * num_clients
            for c in range(num_classes):
                chosen = [i for i in range(num_clients) if left[i] > 0]
                if not chosen:
                    break
                chosen = chosen[: int(np.ceil(num_clients / num_classes * class_per_client))]
                per = len(by_class[c]) / len(chosen)
                if balance:
                    sizes = [int(per)] * (len(chosen) - 1)
                else:
                    sizes = np.random.randint(max(per / 10, least / num_classes), per, len(chosen) - 1).tolist()
                sizes.append(len(by_class[c]) - sum(sizes))
                start = 0
                for i, size in zip(chosen, sizes):
                    piece = by_class[c][start : start + size]
                    client_idx[i] = piece if i not in client_idx else np.append(client_idx[i], piece, axis=0)
                    start += size
                    left[i] -= 1
        else:
            smallest = 0
            while smallest < least:
                batches: list[list[int]] = [[] for _ in range(num_clients)]
                for c in range(num_classes):
                    idx = np.where(labels == c)[0]
                    np.random.shuffle(idx)
                    p = np.random.dirichlet(np.repeat(alpha, num_clients))
                    p = np.array([q * (len(b) < len(labels) / num_clients) for q, b in zip(p, batches)])
                    p = p / p.sum()
                    cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
                    batches = [b + part.tolist() for b, part in zip(batches, np.split(idx, cuts))]
                    smallest = min(len(b) for b in batches)
            client_idx = dict(enumerate(batches))
        train, test = [], []
        for i in range(num_clients):
            idx = np.asarray(client_idx[i])
            tr, te = train_test_split(idx, train_size=TRAIN_RATIO, shuffle=True)
            train.append(np.sort(tr))
            test.append(np.sort(te))
        return train, test
    finally:
        np.random.set_state(state)


def pool(n_per_class: list[int], seed: int = 0) -> np.ndarray:
    labels = np.concatenate([np.full(n, c) for c, n in enumerate(n_per_class)])
    return labels[np.random.default_rng(seed).permutation(len(labels))]


@pytest.mark.parametrize("seed", [1, 7])
def test_dirichlet_matches_pfllib_sample_for_sample(seed):
    labels = pool([130, 90, 160, 70, 110, 100, 140, 80, 120, 95])
    train, test = pfllib_reference(labels, 8, "dir", 0.3, 2, False, seed)
    split = split_clients(labels, PartitionSpec(method="dirichlet", num_clients=8, alpha=0.3, rng="pfllib"), seed)
    assert all(np.array_equal(a, b) for a, b in zip(train, split.train))
    assert all(np.array_equal(a, b) for a, b in zip(test, split.test))
    # test = the first ceil(25 %) of sklearn's permutation, as PFLlib's split_data
    assert all(len(te) == math.ceil(0.25 * (len(tr) + len(te))) for tr, te in zip(split.train, split.test))
    default = split_clients(labels, PartitionSpec(method="dirichlet", num_clients=8, alpha=0.3), seed)
    assert not all(np.array_equal(a, b) for a, b in zip(train, default.train)), "pflkit's own stream differs"


@pytest.mark.parametrize("balanced", [False, True])
def test_pathological_matches_pfllib_sample_for_sample(balanced):
    labels = pool([60, 55, 70, 65, 50, 58, 62, 66, 54, 61])
    train, test = pfllib_reference(labels, 10, "pat", 0.1, 2, balanced, 1)
    spec = PartitionSpec(method="pathological", num_clients=10, classes_per_client=2, balanced=balanced, rng="pfllib")
    split = split_clients(labels, spec, 1)
    assert all(np.array_equal(a, b) for a, b in zip(train, split.train))
    assert all(np.array_equal(a, b) for a, b in zip(test, split.test))


def test_iid_is_pfllibs_pathological_rule_with_every_class():
    labels = pool([40] * 10)
    train, _ = pfllib_reference(labels, 5, "pat", 0.1, 10, True, 3)
    split = split_clients(labels, PartitionSpec(method="iid", num_clients=5, balanced=True, rng="pfllib"), 3)
    assert all(np.array_equal(a, b) for a, b in zip(train, split.train))


# Per-client class counts of the MNIST split the FedALA repository ships (TsingZ0/FedALA,
# dataset/mnist-0.1-npz: train/train<i>_.npz, test/test<i>_.npz; 20 clients, Dir(0.1), seed 1).
FEDALA_TRAIN_COUNTS = [
    [101, 662, 0, 0, 1, 245, 0, 23, 796, 144],
    [5, 0, 22, 0, 0, 15, 245, 0, 6, 81],
    [2, 0, 0, 105, 0, 0, 1098, 0, 0, 17],
    [119, 0, 0, 0, 1, 0, 0, 1782, 3, 0],
    [51, 10, 0, 165, 0, 835, 6, 0, 27, 343],
    [0, 27, 0, 1, 27, 0, 0, 0, 17, 4569],
    [0, 652, 122, 39, 0, 0, 31, 0, 9, 89],
    [0, 15, 4, 10, 0, 590, 0, 4, 328, 0],
    [1, 2699, 0, 0, 0, 0, 0, 0, 0, 0],
    [478, 1473, 77, 0, 404, 0, 572, 0, 0, 0],
    [683, 1, 1087, 399, 96, 71, 0, 0, 0, 0],
    [0, 0, 120, 2270, 0, 439, 0, 0, 0, 0],
    [4, 135, 2451, 0, 0, 119, 0, 0, 0, 0],
    [0, 191, 254, 0, 5, 335, 0, 815, 0, 0],
    [0, 0, 0, 0, 0, 2035, 0, 2262, 0, 0],
    [22, 0, 0, 1353, 0, 12, 2, 571, 2126, 0],
    [2721, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [0, 20, 1090, 1038, 261, 48, 0, 9, 1773, 0],
    [757, 0, 0, 0, 0, 5, 3187, 0, 0, 0],
    [232, 1, 0, 0, 4343, 0, 0, 0, 0, 1],
]
FEDALA_TEST_COUNTS = [
    [39, 228, 0, 0, 0, 74, 0, 6, 271, 40],
    [0, 0, 5, 0, 0, 4, 90, 0, 0, 26],
    [1, 0, 0, 38, 0, 0, 363, 0, 0, 6],
    [36, 0, 0, 0, 0, 0, 0, 599, 1, 0],
    [20, 3, 0, 42, 0, 294, 0, 0, 13, 108],
    [0, 11, 0, 0, 12, 0, 0, 0, 8, 1517],
    [0, 221, 54, 7, 0, 0, 11, 0, 4, 17],
    [0, 6, 1, 1, 0, 197, 0, 0, 113, 0],
    [0, 900, 0, 0, 0, 0, 0, 0, 0, 0],
    [155, 524, 12, 0, 115, 0, 196, 0, 0, 0],
    [237, 1, 363, 114, 38, 26, 0, 0, 0, 0],
    [0, 0, 39, 785, 0, 119, 0, 0, 0, 0],
    [4, 45, 826, 0, 0, 29, 0, 0, 0, 0],
    [0, 46, 89, 0, 1, 118, 0, 280, 0, 0],
    [0, 0, 0, 0, 0, 684, 0, 749, 0, 0],
    [9, 0, 0, 432, 0, 4, 2, 185, 730, 0],
    [907, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [0, 6, 373, 341, 74, 12, 0, 8, 600, 0],
    [241, 0, 0, 0, 0, 3, 1073, 0, 0, 0],
    [78, 0, 1, 1, 1446, 0, 0, 0, 0, 0],
]


@pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason="needs ../shared/datasets/mnist")
def test_pfllib_rng_reproduces_the_fedala_repository_mnist_split():
    """The partition depends only on the labels (the official label files): seed 1 gives the
    FedALA repository's split, class counts identical client by client, train and test."""
    labels = load_dataset("mnist", SHARED_MNIST).y.numpy()
    split = split_clients(labels, PartitionSpec(method="dirichlet", num_clients=20, alpha=0.1, rng="pfllib"), 1)
    assert [np.bincount(labels[t], minlength=10).tolist() for t in split.train] == FEDALA_TRAIN_COUNTS
    assert [np.bincount(labels[t], minlength=10).tolist() for t in split.test] == FEDALA_TEST_COUNTS

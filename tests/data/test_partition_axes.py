"""FedAvg's shards, a given client x class matrix, quantity skew and an IID share: their promises
checked on the clients' samples, and their bad inputs refused with one line."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from pflkit.data import PartitionError, PartitionSpec, split_clients
from pflkit.data.partition.shards import partition_shards

LABELS = np.repeat(np.arange(10), 700)[np.random.default_rng(5).permutation(7000)]


def parts_of(seed: int = 0, labels: np.ndarray = LABELS, **kw: object) -> list[np.ndarray]:
    """Each client's samples (train and test together) for 20 clients and the keys ``kw``."""
    split = split_clients(labels, PartitionSpec(num_clients=kw.pop("num_clients", 20), **kw), seed)  # type: ignore[arg-type]
    return [np.sort(np.concatenate([tr, te])) for tr, te in zip(split.train, split.test)]


def counts_of(parts: list[np.ndarray], labels: np.ndarray = LABELS) -> np.ndarray:
    return np.stack([np.bincount(labels[p], minlength=10) for p in parts])


def check_disjoint(parts: list[np.ndarray], everything: bool = True) -> None:
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)
    if everything:
        assert len(joined) == 7000


# ---------------------------------------------------------------- shards


def test_shards_cut_the_label_sorted_pool():
    labels = np.repeat(np.arange(4), [53, 47, 61, 39])  # 200 samples, classes of uneven size
    parts = partition_shards(labels, 7, 3, np.random.default_rng(0))  # 21 shards of 9 or 10
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(200))
    assert max(map(len, parts)) - min(map(len, parts)) <= 3
    # a shard holds consecutive samples of the label-sorted pool: at most 2 classes per shard
    assert all(len(np.unique(labels[p])) <= 6 for p in parts)
    same = partition_shards(labels, 7, 3, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(parts, same))
    assert not all(
        np.array_equal(a, b) for a, b in zip(parts, partition_shards(labels, 7, 3, np.random.default_rng(1)))
    )
    with pytest.raises(
        PartitionError, match="num_clients=70 x shards_per_client=3 = 210 shards, but the pool holds 200"
    ):
        partition_shards(labels, 70, 3, np.random.default_rng(0))


def test_shards_under_pfllibs_generator_and_too_many_clients():
    a = parts_of(3, method="shards", rng="pfllib")
    assert all(np.array_equal(x, y) for x, y in zip(a, parts_of(3, method="shards", rng="pfllib")))
    check_disjoint(a)
    with pytest.raises(PartitionError, match="num_clients=20 needs at least 40 samples"):
        parts_of(0, LABELS[:39], method="shards")


# ---------------------------------------------------------------- a given matrix


def test_a_count_matrix_is_met_exactly():
    matrix = [[(i + k) % 7 * 10 for k in range(10)] for i in range(20)]
    parts = parts_of(2, method="matrix", class_matrix=matrix)
    assert counts_of(parts).tolist() == matrix
    check_disjoint(parts, everything=False)
    assert all(np.array_equal(a, b) for a, b in zip(parts, parts_of(2, method="matrix", class_matrix=matrix)))


def test_a_fraction_matrix_hands_out_shares_of_each_class():
    matrix = [[0.05] * 5 + [0.1 * (i < 10)] * 5 for i in range(20)]  # classes 5-9 go to clients 0-9 only
    counts = counts_of(parts_of(0, method="matrix", class_matrix=matrix))
    assert np.all(counts[:, :5] == 35) and np.all(counts[:10, 5:] == 70) and np.all(counts[10:, 5:] == 0)


@pytest.mark.parametrize(
    ("matrix", "message"),
    [
        ([[35] * 9] * 20, "class_matrix has 9 columns, but the labels hold 10 classes"),
        ([[36] * 10] * 20, "class_matrix asks for 720 samples of class 0, but the pool holds 700"),
        ([[0.06] * 10] * 20, "class_matrix gives away 1.2 of class 0's samples"),
        ([[1] + [0] * 9] + [[35] * 10] * 19, "class_matrix gives client 0 1 sample"),
    ],
)
def test_an_impossible_matrix_is_refused_in_one_line(matrix, message):
    with pytest.raises(PartitionError, match=message) as caught:
        parts_of(0, method="matrix", class_matrix=matrix)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"method": "matrix", "class_matrix": [[35] * 10] * 19}, "class_matrix must have num_clients = 20 rows"),
        ({"method": "matrix", "class_matrix": [[35] * 10] * 19 + [[35] * 9]}, "rows of one length"),
        ({"method": "matrix", "class_matrix": [[-1] * 10] * 20}, "negative entry"),
        ({"method": "matrix"}, 'read by partition = "matrix" and needed there'),
        ({"class_matrix": [[35] * 10] * 20}, 'read by partition = "matrix" and needed there'),
        ({"quantity": "given"}, 'read by quantity = "given"'),
        ({"client_sizes": [350] * 20}, 'read by quantity = "given"'),
        ({"quantity": "given", "client_sizes": [350] * 19}, "client_sizes has 19 entries, num_clients = 20"),
        ({"quantity": "given", "client_sizes": [-5] + [350] * 19}, "negative size"),
        ({"quantity": "given", "client_sizes": [0.1] * 20}, "fractions summing to 2 > 1"),
        ({"iid_share": 1.5}, "less than or equal to 1"),
        ({"quantity_sigma": 0.0}, "greater than 0"),
        ({"shards_per_client": 0}, "greater than or equal to 1"),
    ],
)
def test_the_config_refuses_keys_that_do_not_fit(keys, message):
    with pytest.raises(ValidationError, match=message):
        PartitionSpec(num_clients=20, **keys)


# ---------------------------------------------------------------- quantity skew


@pytest.mark.parametrize("method", ["iid", "dirichlet", "pathological", "shards", "exdir", "kfold"])
def test_lognormal_sizes_on_any_label_partition(method):
    keys = {"alpha": 100.0} if method == "exdir" else {}
    parts = parts_of(1, method=method, quantity="lognormal", quantity_sigma=1.0, **keys)
    sizes = np.array([len(p) for p in parts])
    base = sum(len(p) for p in parts_of(1, method=method, **keys))
    check_disjoint(parts, everything=False)
    assert sizes.sum() == base  # the samples the label partition used, all used again
    assert sizes.min() >= 40  # PFLlib's least_samples, min(10 / 0.25, 7000 / 20 / 2)
    assert sizes.max() > 3 * sizes.min()
    assert all(np.array_equal(a, b) for a, b in zip(parts, parts_of(1, method=method, quantity="lognormal", **keys)))


def test_quantity_keeps_the_label_mix_where_classes_allow():
    """Uniform label mixes stay uniform (within 3 samples: each class's rounding) at linear sizes."""
    counts = counts_of(parts_of(0, method="matrix", class_matrix=[[35] * 10] * 20, quantity="linear"))
    sizes = counts.sum(1)
    assert np.all(np.diff(sizes) > 0) and sizes.sum() == 7000  # client i weighs i + 1
    assert np.all(np.abs(counts - sizes[:, None] / 10) <= 3)
    wide = parts_of(0, method="iid", quantity="lognormal", quantity_sigma=2.0)
    narrow = parts_of(0, method="iid", quantity="lognormal", quantity_sigma=0.2)
    assert np.std([len(p) for p in wide]) > 3 * np.std([len(p) for p in narrow])


def test_given_sizes_equal_to_the_partitions_keep_its_samples():
    plain = parts_of(4, method="pathological")
    same = parts_of(4, method="pathological", quantity="given", client_sizes=[len(p) for p in plain])
    assert all(np.array_equal(a, b) for a, b in zip(plain, same))


def test_given_sizes_counts_and_fractions():
    sizes = [100 + 10 * i for i in range(20)]
    parts = parts_of(0, method="dirichlet", alpha=1.0, quantity="given", client_sizes=sizes)
    assert [len(p) for p in parts] == sizes
    check_disjoint(parts, everything=False)
    half = parts_of(0, method="iid", quantity="given", client_sizes=[0.025] * 20)
    assert [len(p) for p in half] == [175] * 20
    whole = parts_of(0, method="iid", quantity="given", client_sizes=[0.1] * 5 + [0.5 / 15] * 15)
    check_disjoint(whole)  # fractions summing to 1: every sample used


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"client_sizes": [400] * 20}, "client_sizes add up to 8000 samples, but the pool holds 7000"),
        ({"client_sizes": [1] + [300] * 19}, "client_sizes give client 0 1 samples; every client needs at least 2"),
        ({"client_sizes": [0] + [300] * 19}, "client_sizes give client 0 0 samples"),
    ],
)
def test_impossible_sizes_are_refused(keys, message):
    with pytest.raises(PartitionError, match=message):
        parts_of(0, method="iid", quantity="given", **keys)


def test_a_least_size_beyond_the_pool_is_refused():
    with pytest.raises(PartitionError, match="num_clients=20 x 400 samples"):
        parts_of(0, method="iid", quantity="lognormal", min_samples_per_client=400)


# ---------------------------------------------------------------- IID share


def test_iid_share_mixes_the_pool_into_each_client():
    plain = counts_of(parts_of(6, method="pathological", balanced=True))
    assert np.all((plain > 0).sum(1) == 2)
    parts = parts_of(6, method="pathological", balanced=True, iid_share=0.4)
    mixed = counts_of(parts)
    check_disjoint(parts)
    assert np.array_equal(mixed.sum(1), plain.sum(1))  # sizes kept
    assert np.array_equal(mixed, plain * 3 // 5 + 14)  # 350 samples: 105 of each own class, 14 of every class
    assert all(
        np.array_equal(a, b)
        for a, b in zip(parts_of(6, method="dirichlet"), parts_of(6, method="dirichlet", iid_share=0.0))
    )


def test_a_full_iid_share_is_iid_and_combines_with_quantity():
    counts = counts_of(parts_of(0, method="dirichlet", quantity="linear", iid_share=1.0))
    sizes = counts.sum(1)
    assert np.all(np.diff(sizes) > 0)
    assert np.all(np.abs(counts - sizes[:, None] / 10) <= 3)


@pytest.mark.parametrize(
    "keys",
    [
        {"method": "pathological", "balanced": True, "iid_share": 0.3},
        {"method": "dirichlet", "quantity": "linear"},
        {"method": "iid", "quantity": "given", "client_sizes": [100 + 10 * i for i in range(20)]},
        {"method": "dirichlet", "quantity": "linear", "iid_share": 0.5},
    ],
)
def test_the_seed_decides_the_parts(keys):
    """The same seed draws the same samples for every client; another seed draws others."""
    first, again, other = parts_of(3, **keys), parts_of(3, **keys), parts_of(4, **keys)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_the_record_names_the_axes():
    split = split_clients(LABELS, PartitionSpec(num_clients=20, quantity="linear", iid_share=0.2), 0)
    assert split.info["quantity"] == "linear" and split.info["iid_share"] == 0.2
    assert "quantity" not in split_clients(LABELS, PartitionSpec(num_clients=20), 0).info


# ---------------------------------------------------------------- words, plot, config


def test_the_plot_title_and_the_partition_plot_show_the_new_partitions(tmp_path):
    from pflkit.data.partition.words import partition_words
    from pflkit.reporting import plot_partition

    spec = PartitionSpec(method="shards", quantity="lognormal", quantity_sigma=0.5, iid_share=0.25)
    assert partition_words(spec) == "shards (2 per client), lognormal sizes (sigma 0.5), 25% iid"
    assert partition_words(PartitionSpec(method="exdir", classes_per_client=3, alpha=100.0)) == (
        "exdir (3 classes per client, alpha 100.0)"
    )
    counts = counts_of(parts_of(0, method="exdir", alpha=100.0, quantity="linear"))
    plot_partition(counts, tmp_path / "partition.png", partition_words(spec))
    assert (tmp_path / "partition.png").stat().st_size > 1000


def test_keys_another_partition_reads_are_named_unused(caplog):
    from pflkit.config import load_config

    load_config(overrides=["partition.shards_per_client=4", "partition.quantity_sigma=2.0"])
    assert "shards_per_client = 4 is not used: only partition = shards reads it" in caplog.text
    assert 'quantity_sigma = 2.0 is not used: only quantity = "lognormal" reads it' in caplog.text
    caplog.clear()
    config = load_config(overrides=["partition=exdir", "partition.classes_per_client=3", "partition.alpha=100.0"])
    assert config.partition.method == "exdir" and "not used" not in caplog.text

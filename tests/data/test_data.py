"""Tests for pflkit.data: IDX I/O, dataset loaders and client partitions."""

from __future__ import annotations

import gzip
import math
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

try:
    import pflkit.data  # noqa: F401
except ImportError:  # package not installed: test the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pflkit.data import (
    DATASETS,
    PARTITION_METHODS,
    DataError,
    Dataset,
    PartitionError,
    PartitionSpec,
    class_counts,
    download_mnist,
    load_dataset,
    read_idx,
    split_clients,
    write_idx,
)
from pflkit.data.partition.dirichlet import partition_dirichlet
from pflkit.data.partition.holdout import split_train_test
from pflkit.data.partition.iid import partition_iid
from pflkit.data.partition.pathological import partition_pathological
from tests.support.paths import SHARED_MNIST

torch.set_num_threads(1)

MNIST_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


# ---------------------------------------------------------------- IDX format


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("shape", [(17,), (5, 28, 28)])
def test_idx_round_trip_ubyte(tmp_path: Path, suffix: str, shape: tuple[int, ...]) -> None:
    arr = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)
    path = tmp_path / f"a-idx{suffix}"
    write_idx(path, arr)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == (suffix == ".gz")
    back = read_idx(path)
    assert back.dtype == np.uint8 and back.shape == shape
    np.testing.assert_array_equal(back, arr)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.float32, np.float64])
def test_idx_round_trip_other_types(tmp_path: Path, dtype: type) -> None:
    arr = (np.arange(24).reshape(2, 3, 4) - 11).astype(dtype) * dtype(3)
    write_idx(tmp_path / "a.gz", arr)
    back = read_idx(tmp_path / "a.gz")
    assert back.dtype == np.dtype(dtype) and back.dtype.isnative
    np.testing.assert_array_equal(back, arr)


def test_idx_header_is_the_standard_layout(tmp_path: Path) -> None:
    write_idx(tmp_path / "x", np.array([[1, 2, 3]], dtype=np.int16))
    assert (tmp_path / "x").read_bytes() == bytes.fromhex("0000 0B02 00000001 00000003 0001 0002 0003")


def test_idx_gzip_detected_by_content_not_name(tmp_path: Path) -> None:
    arr = np.arange(10, dtype=np.uint8)
    write_idx(tmp_path / "compressed.idx", arr, compress=True)
    write_idx(tmp_path / "plain.gz", arr, compress=False)
    np.testing.assert_array_equal(read_idx(tmp_path / "compressed.idx"), arr)
    np.testing.assert_array_equal(read_idx(tmp_path / "plain.gz"), arr)


@pytest.mark.parametrize("delta", [-1, +3])
def test_idx_wrong_payload_size(tmp_path: Path, delta: int) -> None:
    path = tmp_path / "labels-idx1-ubyte"
    write_idx(path, np.arange(10, dtype=np.uint8))
    raw = path.read_bytes()
    path.write_bytes(raw[:delta] if delta < 0 else raw + b"\0" * delta)
    with pytest.raises(DataError, match="labels-idx1-ubyte") as info:
        read_idx(path)
    assert "10" in str(info.value) and str(10 + delta) in str(info.value)


def test_idx_truncated_gzip_payload(tmp_path: Path) -> None:
    # A valid gzip stream whose IDX content is too short.
    raw = bytes.fromhex("0000 0801 00000005") + b"\1\2\3"
    (tmp_path / "short.gz").write_bytes(gzip.compress(raw))
    with pytest.raises(DataError, match="short.gz"):
        read_idx(tmp_path / "short.gz")


@pytest.mark.parametrize("damage", ["cut", "flip"])
def test_idx_corrupt_gzip(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "images.gz"
    write_idx(path, np.random.default_rng(1).integers(0, 256, size=(4, 28, 28), dtype=np.uint8))
    raw = bytearray(path.read_bytes())
    if damage == "cut":
        raw = raw[: len(raw) // 2]
    else:
        raw[len(raw) // 2] ^= 0xFF
        raw[len(raw) // 2 + 1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="images.gz"):
        read_idx(path)


@pytest.mark.parametrize("header", [bytes.fromhex("0100 0801 00000001"), bytes.fromhex("0000 0701 00000001")])
def test_idx_bad_magic_or_type(tmp_path: Path, header: bytes) -> None:
    (tmp_path / "bad").write_bytes(header + b"\0")
    with pytest.raises(DataError, match="bad"):
        read_idx(tmp_path / "bad")


def test_idx_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nothere"):
        read_idx(tmp_path / "nothere")


# ---------------------------------------------------------------- MNIST loader


def _write_mnist(root: Path, n_train: int = 30, n_test: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Write small MNIST files (mixed plain/gz); return all images and labels, train first."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n_train + n_test, 28, 28), dtype=np.uint8)
    images[0, 0, 0], images[0, 0, 1] = 0, 255
    labels = rng.integers(0, 10, size=n_train + n_test).astype(np.uint8)
    write_idx(root / "train-images-idx3-ubyte.gz", images[:n_train])
    write_idx(root / "train-labels-idx1-ubyte", labels[:n_train])
    write_idx(root / "t10k-images-idx3-ubyte", images[n_train:])
    write_idx(root / "t10k-labels-idx1-ubyte.gz", labels[n_train:])
    return images, labels


def test_mnist_small_files(tmp_path: Path) -> None:
    images, labels = _write_mnist(tmp_path)
    ds = load_dataset("mnist", tmp_path)
    assert isinstance(ds, Dataset) and ds.name == "mnist" and ds.num_classes == 10
    assert ds.x.shape == (40, 1, 28, 28) and ds.x.dtype == torch.float32
    assert ds.y.dtype == torch.int64 and len(ds) == 40 and ds.input_shape == (1, 28, 28)
    assert ds.x.min() == -1.0 and ds.x.max() == 1.0
    expected = (images.astype(np.float32) / 255 - 0.5) / 0.5
    np.testing.assert_allclose(ds.x[:, 0].numpy(), expected, atol=1e-6)
    np.testing.assert_array_equal(ds.y.numpy(), labels)


def test_mnist_accepts_str_dir(tmp_path: Path) -> None:
    _write_mnist(tmp_path, n_train=3, n_test=2)
    assert len(load_dataset("mnist", str(tmp_path))) == 5


@pytest.mark.parametrize("missing", MNIST_NAMES)
def test_mnist_missing_file(tmp_path: Path, missing: str) -> None:
    _write_mnist(tmp_path)
    for p in tmp_path.glob(missing + "*"):
        p.unlink()
    with pytest.raises(DataError, match=missing) as info:
        load_dataset("mnist", tmp_path)
    msg = str(info.value)
    assert str(tmp_path) in msg and "pflkit download mnist" in msg


@pytest.mark.parametrize("data_dir", [None, "does-not-exist"])
def test_mnist_bad_dir(tmp_path: Path, data_dir: str | None) -> None:
    arg = None if data_dir is None else tmp_path / data_dir
    with pytest.raises(DataError, match="pflkit download mnist"):
        load_dataset("mnist", arg)


def test_mnist_count_mismatch(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros(9, dtype=np.uint8))
    with pytest.raises(DataError, match="10 images.*9 labels"):
        load_dataset("mnist", tmp_path)


def test_mnist_bad_image_shape(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    (tmp_path / "train-images-idx3-ubyte.gz").unlink()
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((30, 28, 27), dtype=np.uint8))
    with pytest.raises(DataError, match="28, 28"):
        load_dataset("mnist", tmp_path)


def test_mnist_label_out_of_range(tmp_path: Path) -> None:
    _write_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.full(30, 10, dtype=np.uint8))
    with pytest.raises(DataError, match="0..9"):
        load_dataset("mnist", tmp_path)


@pytest.mark.skipif(not SHARED_MNIST.is_dir(), reason="shared MNIST copy not available")
def test_mnist_real_files() -> None:
    ds = load_dataset("mnist", SHARED_MNIST)
    assert ds.x.shape == (70_000, 1, 28, 28)
    counts = np.bincount(ds.y.numpy(), minlength=10)
    assert len(counts) == 10 and counts.sum() == 70_000 and counts.min() > 6000
    assert float(ds.x.min()) == -1.0 and float(ds.x.max()) == 1.0


def test_download_mnist_tries_mirrors_verifies_and_skips_present_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pflkit.data import sources
    from pflkit.data.fetch import md5sum

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    write_idx(mirror / "train-images-idx3-ubyte.gz", np.zeros((60000, 28, 28), dtype=np.uint8))
    write_idx(mirror / "train-labels-idx1-ubyte.gz", np.zeros(60000, dtype=np.uint8))
    write_idx(mirror / "t10k-images-idx3-ubyte.gz", np.zeros((10000, 28, 28), dtype=np.uint8))
    write_idx(mirror / "t10k-labels-idx1-ubyte.gz", np.zeros(10000, dtype=np.uint8))
    md5 = {name: md5sum(mirror / name) for name in sources._MNIST_MD5}
    monkeypatch.setattr(sources, "_MNIST_MIRRORS", ((tmp_path / "down").as_uri() + "/", mirror.as_uri() + "/"))
    monkeypatch.setattr(sources, "_MNIST_MD5", md5)
    target = tmp_path / "mnist"
    assert download_mnist(target) == target  # the first mirror is down: the second serves every file
    assert len(load_dataset("mnist", target)) == 70000 and not list(target.glob(".*part"))
    (mirror / "t10k-labels-idx1-ubyte.gz").unlink()
    assert download_mnist(target) == target  # present files are not fetched again
    (target / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="could not download t10k-labels-idx1-ubyte.gz"):
        download_mnist(target)
    write_idx(mirror / "t10k-labels-idx1-ubyte.gz", np.ones(10000, dtype=np.uint8))  # wrong md5
    with pytest.raises(DataError, match="md5"):
        download_mnist(target)
    assert not (target / "t10k-labels-idx1-ubyte.gz").exists()


# ---------------------------------------------------------------- other sources


def test_digits() -> None:
    ds = load_dataset("digits")
    assert len(ds) == 1797 and ds.num_classes == 10 and ds.input_shape == (1, 8, 8)
    assert ds.x.dtype == torch.float32 and ds.y.dtype == torch.int64
    assert ds.x.min() == -1.0 and ds.x.max() == 1.0
    assert set(ds.y.tolist()) == set(range(10))


def test_synthetic_deterministic_balanced_separable() -> None:
    np.random.seed(1)
    torch.manual_seed(1)
    a = load_dataset("synthetic")
    np.random.seed(2)
    torch.manual_seed(2)
    b = load_dataset("synthetic")
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert len(a) == 1000 and a.num_classes == 10 and a.input_shape == (1, 8, 8)
    assert a.x.dtype == torch.float32 and a.y.dtype == torch.int64
    assert np.bincount(a.y.numpy()).tolist() == [100] * 10
    # Learnable: a nearest-class-mean rule fitted on half the data classifies the rest.
    x, y = a.x.flatten(1).numpy(), a.y.numpy()
    means = np.stack([x[:500][y[:500] == c].mean(0) for c in range(10)])
    pred = ((x[500:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (pred == y[500:]).mean() > 0.9


def test_unknown_dataset() -> None:
    with pytest.raises(ValueError, match="cifar") as info:
        load_dataset("cifar")
    assert all(name in str(info.value) for name in DATASETS)


def test_dataset_validates_tensors() -> None:
    with pytest.raises(ValueError):
        Dataset("bad", torch.zeros(3, 1, 2, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.int64), 2)
    with pytest.raises(ValueError):
        Dataset("bad", torch.zeros(3, 1, 2, 2), torch.zeros(4, dtype=torch.int64), 2)


# ---------------------------------------------------------------- partitions


@pytest.fixture(scope="module")
def mnist_like() -> np.ndarray:
    """10 classes x 700 samples in shuffled order."""
    labels = np.repeat(np.arange(10), 700)
    return labels[np.random.default_rng(123).permutation(len(labels))]


METHODS = ["iid", "dirichlet", "pathological"]


def _split(labels: np.ndarray, method: str, seed: int, **kw: object) -> list[np.ndarray]:
    """Every client's samples (training and test data together, sorted) as ``split_clients`` gives them
    for 20 clients, the partition seed ``seed`` and the spec keys ``kw``."""
    split = split_clients(labels, PartitionSpec(method=method, num_clients=20, **kw), seed)
    return [np.sort(np.concatenate([tr, te])) for tr, te in zip(split.train, split.test)]


@pytest.mark.parametrize("method", METHODS)
def test_partition_disjoint_complete_sorted(mnist_like: np.ndarray, method: str) -> None:
    parts = _split(mnist_like, method, 1)
    assert len(parts) == 20
    for p in parts:
        assert p.dtype == np.int64 and len(p) > 0 and np.all(np.diff(p) > 0)
    everything = np.concatenate(parts)
    # Complete: with 20 clients x 2 classes every class is assigned, so pathological covers all too.
    assert np.array_equal(np.sort(everything), np.arange(len(mnist_like)))


@pytest.mark.parametrize("method", METHODS)
def test_partition_seeded(mnist_like: np.ndarray, method: str) -> None:
    state = np.random.get_state()
    np.random.seed(5)
    a = _split(mnist_like, method, 1)
    np.random.seed(6)
    b = _split(mnist_like, method, 1)
    c = _split(mnist_like, method, 2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    np.random.set_state(state)


@pytest.mark.parametrize("method", METHODS)
def test_partition_leaves_global_rng_alone(mnist_like: np.ndarray, method: str) -> None:
    np.random.seed(7)
    before = np.random.random()
    np.random.seed(7)
    _split(mnist_like, method, 3)
    assert np.random.random() == before


def test_iid_near_equal(mnist_like: np.ndarray) -> None:
    sizes = [len(p) for p in partition_iid(mnist_like[:6993], 20, np.random.default_rng(0))]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 6993 and min(sizes) == 349


def test_iid_too_many_clients() -> None:
    with pytest.raises(PartitionError, match="num_clients=5"):
        partition_iid(np.zeros(4, dtype=np.int64), 5, np.random.default_rng(0))


@pytest.mark.parametrize("seed", range(5))
def test_dirichlet_min_samples_and_cap(mnist_like: np.ndarray, seed: int) -> None:
    parts = partition_dirichlet(mnist_like, 20, 0.1, np.random.default_rng(seed), min_samples_per_client=100)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 100 and sizes.sum() == len(mnist_like)
    # The cap stops feeding a client once it holds the average (350), so it can
    # overshoot by at most one class (700 samples).
    assert sizes.max() < 350 + 700


def test_dirichlet_default_min_samples() -> None:
    labels = np.repeat(np.arange(10), 20)  # 200 samples, 4 clients -> default min(40, 25) = 25
    for seed in range(5):
        parts = partition_dirichlet(labels, 4, 0.05, np.random.default_rng(seed))
        assert min(len(p) for p in parts) >= 25


def test_dirichlet_without_cap_can_concentrate(mnist_like: np.ndarray) -> None:
    biggest = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        parts = partition_dirichlet(mnist_like, 20, 0.1, rng, balance_cap=False, min_samples_per_client=0)
        biggest.append(max(len(p) for p in parts))
    assert max(biggest) >= 350 + 700


def test_dirichlet_without_minimum_leaves_no_client_empty() -> None:
    # FedACD's Dir(0.05) over 20 clients with no minimum: single draws often leave a client
    # empty (MNIST's official split: client 12 of partition seed 0); such draws are redrawn.
    labels = np.repeat(np.arange(10), 600)
    for seed in range(5):
        parts = partition_dirichlet(
            labels, 20, 0.05, np.random.default_rng(seed), balance_cap=False, min_samples_per_client=0
        )
        assert min(len(p) for p in parts) >= 1
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_dirichlet_cap_all_zero_fallback() -> None:
    # Tiny alpha puts all mass on one client; once that client is capped the
    # capped proportions are all zero and must not produce NaNs.
    labels = np.repeat(np.arange(20), 50)
    for seed in range(10):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a 0/0 division would warn
            parts = partition_dirichlet(labels, 5, 1e-4, np.random.default_rng(seed), min_samples_per_client=0)
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1000))


def test_dirichlet_impossible_requests(mnist_like: np.ndarray) -> None:
    with pytest.raises(PartitionError, match="min_samples_per_client=400") as info:
        partition_dirichlet(mnist_like, 20, 0.1, np.random.default_rng(0), min_samples_per_client=400)
    assert "num_clients=20" in str(info.value)
    with pytest.raises(PartitionError, match="alpha") as info:
        partition_dirichlet(mnist_like, 100, 0.001, np.random.default_rng(0), min_samples_per_client=60, max_retries=5)
    msg = str(info.value)
    assert "num_clients=100" in msg and "min_samples_per_client=60" in msg and "smallest client" in msg
    assert "lower num_clients" in msg and "raise alpha" in msg
    with pytest.raises(PartitionError, match="alpha"):
        partition_dirichlet(mnist_like, 20, 0.0, np.random.default_rng(0))
    with pytest.raises(PartitionError, match="num_clients"):
        partition_dirichlet(mnist_like, 0, 0.1, np.random.default_rng(0))


@pytest.mark.parametrize("balanced", [False, True])
def test_pathological_groups(mnist_like: np.ndarray, balanced: bool) -> None:
    parts = partition_pathological(mnist_like, 20, 2, np.random.default_rng(1), balanced=balanced)
    counts = class_counts(mnist_like, parts, 10)
    assert np.all((counts > 0).sum(1) == 2)
    class_sets = [tuple(np.flatnonzero(row)) for row in counts]
    groups = {s: [i for i, t in enumerate(class_sets) if t == s] for s in set(class_sets)}
    assert len(groups) == 5 and all(len(g) == 4 for g in groups.values())
    # Classes are dealt in order: clients 0-3 get {0,1}, 4-7 {2,3}, ...
    assert sorted(groups.values()) == [list(range(4 * g, 4 * g + 4)) for g in range(5)]
    per_class = counts[counts > 0].reshape(20, 2)
    if balanced:
        assert np.all(per_class == 175)
    else:
        # First three clients of a group: randint(max(175/10, 40/10), 175); the last takes the rest.
        firsts = np.concatenate([counts[4 * g : 4 * g + 3, 2 * g : 2 * g + 2].ravel() for g in range(5)])
        assert firsts.min() >= 17 and firsts.max() < 175 and len(set(firsts.tolist())) > 5


def test_pathological_covers_assigned_classes() -> None:
    labels = np.repeat(np.arange(10), 30)
    parts = partition_pathological(labels, 5, 2, np.random.default_rng(0))
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(300))
    counts = class_counts(labels, parts, 10)
    assert np.all((counts > 0).sum(1) == 2)


def test_pathological_impossible_requests(mnist_like: np.ndarray) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(PartitionError, match="classes_per_client=11"):
        partition_pathological(mnist_like, 20, 11, rng)
    with pytest.raises(PartitionError, match="classes_per_client=0"):
        partition_pathological(mnist_like, 20, 0, rng)
    with pytest.raises(PartitionError, match="num_clients=4"):
        partition_pathological(mnist_like, 4, 2, rng)  # int(4 / 10 * 2) = 0 clients per class
    with pytest.raises(PartitionError, match=r"clients \[10, 11, 12, 13, 14\] got no data"):
        partition_pathological(mnist_like, 15, 1, rng)


def test_split_train_test(mnist_like: np.ndarray) -> None:
    parts = _split(mnist_like, "dirichlet", 4)
    train, test = split_train_test(parts, 0.75, np.random.default_rng(0))
    for p, tr, te in zip(parts, train, test):
        assert len(tr) == math.floor(0.75 * len(p)) and len(tr) + len(te) == len(p)
        assert len(np.intersect1d(tr, te)) == 0
        assert np.array_equal(np.sort(np.concatenate([tr, te])), p)
        assert np.all(np.diff(tr) > 0) and np.all(np.diff(te) > 0)
    again, _ = split_train_test(parts, 0.75, np.random.default_rng(0))
    other, _ = split_train_test(parts, 0.75, np.random.default_rng(1))
    assert all(np.array_equal(a, b) for a, b in zip(train, again))
    assert not all(np.array_equal(a, b) for a, b in zip(train, other))


def test_split_train_test_empty_train() -> None:
    parts = [np.arange(10), np.array([10])]
    with pytest.raises(PartitionError, match="client 1 got 1 sample.*min_samples_per_client"):
        split_train_test(parts, 0.75, np.random.default_rng(0))


def test_class_counts(mnist_like: np.ndarray) -> None:
    parts = _split(mnist_like, "dirichlet", 2)
    counts = class_counts(mnist_like, parts, 10)
    assert counts.shape == (20, 10) and counts.dtype == np.int64
    assert counts.sum(1).tolist() == [len(p) for p in parts]
    assert counts.sum(0).tolist() == [700] * 10
    assert counts[0].tolist() == np.bincount(mnist_like[parts[0]], minlength=10).tolist()


def _dispatched(labels: np.ndarray, method: str, seed: int = 3, **kw: object) -> tuple[list[np.ndarray], np.ndarray]:
    """``split_clients``'s parts (checked disjoint, sorted, non-empty int64) and their class counts."""
    parts = _split(labels, method, seed, **kw)
    assert len(parts) == 20
    for p in parts:
        assert p.dtype == np.int64 and len(p) > 0 and np.all(np.diff(p) > 0)
    everything = np.concatenate(parts)
    assert len(np.unique(everything)) == len(everything)  # disjoint
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])  # computed here, not by pflkit
    return parts, counts


def _top_share(counts: np.ndarray) -> float:
    """Mean over clients of the largest class's share of the client's samples (0.1: uniform labels)."""
    return float((counts.max(1) / counts.sum(1)).mean())


#: The keys a method cannot do without.
NEEDS: dict[str, dict[str, object]] = {"matrix": {"class_matrix": [[35] * 10] * 20}}


@pytest.mark.parametrize("method", PARTITION_METHODS)
def test_partition_dispatch(mnist_like: np.ndarray, method: str) -> None:
    """``split_clients`` gives what each method promises, checked on the clients' samples themselves
    (10 classes x 700 samples, 20 clients), and passes the spec's keys on to the method."""
    parts, counts = _dispatched(mnist_like, method, **NEEDS.get(method, {}))
    sizes = counts.sum(1)
    # every method covers the pool here: 7000 = 20 x 350, and pathological's 20 x 2 slots cover 10 classes
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(7000))
    if method == "iid":
        assert sizes.max() - sizes.min() <= 1
        assert np.all(counts > 0) and _top_share(counts) < 0.2  # every label, none dominant (35 +- 6 each)
    elif method == "dirichlet":
        assert sizes.min() >= 40  # PFLlib's least_samples: min(10 / 0.25, 7000 / 20 / 2)
        assert sizes.max() < 350 + 700  # the balance cap: fed until the average, then one class at most
        skewed, spread = _top_share(counts), _top_share(_dispatched(mnist_like, method, alpha=1000.0)[1])
        assert skewed > 0.5 and spread < 0.2  # alpha=0.1 concentrates labels; alpha=1000 is near-iid
        assert (counts > 0).sum(1).mean() < 6
        for seed in range(10):  # the cap really is on by default ...
            assert max(len(p) for p in _split(mnist_like, method, seed)) < 350 + 700
        # (2 samples: the fewest a client can split into training and test data)
        uncapped = [
            max(len(p) for p in _split(mnist_like, method, seed, balance_cap=False, min_samples_per_client=2))
            for seed in range(10)
        ]
        assert max(uncapped) >= 350 + 700  # ... and balance_cap=False reaches the partitioner
        _, counts100 = _dispatched(mnist_like, method, min_samples_per_client=100, seed=0)
        assert counts100.sum(1).min() >= 100
        with pytest.raises(PartitionError, match="min_samples_per_client=400"):
            _split(mnist_like, method, 0, min_samples_per_client=400)
    elif method == "pathological":
        assert np.all((counts > 0).sum(1) == 2)  # classes_per_client defaults to 2
        assert len(set((counts > 0).sum(1))) == 1
        unbalanced = counts[counts > 0]
        assert unbalanced.min() >= 17 and len(set(unbalanced.tolist())) > 5  # random chunk sizes by default
        _, balanced = _dispatched(mnist_like, method, balanced=True)
        assert np.all((balanced > 0).sum(1) == 2) and np.all(balanced[balanced > 0] == 175)  # 700 / 4 clients
        _, five = _dispatched(mnist_like, method, classes_per_client=5, balanced=True)
        assert np.all((five > 0).sum(1) == 5) and np.all(five[five > 0] == 70)  # 10 clients per class
        with pytest.raises(PartitionError, match="classes_per_client=11"):
            _split(mnist_like, method, 0, classes_per_client=11)
    elif method == "kfold":  # 2 folds: clients 0-9 lean on classes 0-4, clients 10-19 on classes 5-9
        assert np.all(sizes == 350)
        for group, primary, other in (
            (slice(0, 10), slice(0, 5), slice(5, 10)),
            (slice(10, 20), slice(5, 10), slice(0, 5)),
        ):
            g = counts[group]
            assert np.all(g == g[0])  # identical label distributions within a group
            assert np.all(g[:, primary] == 56) and np.all(g[:, other] == 14)  # 80% of 350 over 5 classes
    elif method == "label_dirichlet":
        assert np.all(sizes == 350)  # equal sizes, floor(7000 / 20)
        assert _top_share(counts) > 0.5 and (counts > 0).sum(1).mean() < 6  # alpha=0.1: label skew
        _, spread = _dispatched(mnist_like, method, alpha=1000.0)
        assert _top_share(spread) < 0.2 and np.all(spread > 0)
    elif method == "shards":  # 40 shards of 175 samples, each inside one class
        assert np.all(sizes == 350) and np.all((counts > 0).sum(1) <= 2)
        assert np.all(counts[counts > 0] % 175 == 0)
        _, five = _dispatched(mnist_like, method, shards_per_client=5)
        assert np.all(five[five > 0] % 70 == 0) and np.all((five > 0).sum(1) <= 5)
        with pytest.raises(PartitionError, match="shards_per_client=400"):
            _split(mnist_like, method, 0, shards_per_client=400)
    elif method == "exdir":  # 2 classes per client, Dir(0.1) among each class's holders
        assert np.all((counts > 0).sum(1) <= 2) and _top_share(counts) > 0.8
        spread = _dispatched(mnist_like, method, alpha=100.0)[1].sum(1)
        assert spread.min() >= 10  # PFLlib's min_require_size (alpha 0.1 keeps the best of 1000 draws)
        _, three = _dispatched(mnist_like, method, classes_per_client=3, alpha=100.0)
        assert np.all((three > 0).sum(1) <= 3) and (three > 0).sum(1).mean() > 2.5
        with pytest.raises(PartitionError, match="classes_per_client=11"):
            _split(mnist_like, method, 0, classes_per_client=11)
    elif method == "matrix":
        assert np.all(counts == 35)
        _, given = _dispatched(
            mnist_like, method, class_matrix=[[70 * (k == i % 10) for k in range(10)] for i in range(20)]
        )
        assert np.all(given.sum(1) == 70) and np.all((given > 0).sum(1) == 1)
    else:
        pytest.fail(f"no expectations written for partition method {method!r}")


def test_partition_dispatch_unknown_method(mnist_like: np.ndarray) -> None:
    with pytest.raises(ValidationError, match="'kfold', 'label_dirichlet', 'shards', 'exdir' or 'matrix'"):
        _split(mnist_like, "kmeans", 0)


def test_idx_header_matches_struct(tmp_path: Path) -> None:
    # Cross-check the writer against a hand-built file as MNIST stores it.
    arr = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    raw = struct.pack(">HBBIII", 0, 0x08, 3, 2, 28, 28) + arr.tobytes()
    (tmp_path / "hand").write_bytes(raw)
    np.testing.assert_array_equal(read_idx(tmp_path / "hand"), arr)
    write_idx(tmp_path / "mine", arr)
    assert (tmp_path / "mine").read_bytes() == raw

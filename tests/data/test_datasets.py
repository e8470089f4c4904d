"""Tests for the real-data readers: CIFAR, Tiny-ImageNet, AG News, PFLlib folders, downloads.

Every test writes tiny files in the real formats under tmp_path; nothing touches the network.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from pflkit.cli import main
from pflkit.config import ConfigError, build_config
from pflkit.data import (
    DataError,
    Dataset,
    PartitionSpec,
    basic_english,
    build_vocab,
    download,
    load_agnews,
    load_cifar,
    load_dataset,
    load_pfllib,
    load_tiny_imagenet,
)
from pflkit.data import downloads as download_module
from pflkit.data import tiny_imagenet as tiny_module
from pflkit.data.agnews import encode
from pflkit.data.federated import ClientData, FederatedData
from pflkit.data.fetch import fetch, md5_check, md5sum
from pflkit.federation import build_partitions
from pflkit.run.experiment import run_experiment

torch.set_num_threads(1)

# ---------------------------------------------------------------- CIFAR

CIFAR10_BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def _pickle(path: Path, obj: dict) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))


def write_cifar10(root: Path, rows: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A cifar-10-batches-py folder under ``root`` with ``rows`` images per batch; returns (data, labels)."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    datas, labels = [], []
    for name in CIFAR10_BATCHES:
        data = rng.integers(0, 256, size=(rows, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, size=rows)]
        _pickle(
            folder / name, {b"batch_label": name.encode(), b"labels": y, b"data": data, b"filenames": [b"f.png"] * rows}
        )
        datas.append(data)
        labels += y
    _pickle(
        folder / "batches.meta",
        {b"label_names": [f"c{i}".encode() for i in range(10)], b"num_vis": 3072, b"num_cases_per_batch": rows},
    )
    return np.concatenate(datas), np.asarray(labels)


def write_cifar100(root: Path, rows: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    datas, labels = [], []
    for name in ("train", "test"):
        data = rng.integers(0, 256, size=(rows, 3072), dtype=np.uint8)
        fine = [int(v) for v in rng.integers(0, 100, size=rows)]
        _pickle(folder / name, {b"data": data, b"fine_labels": fine, b"coarse_labels": [0] * rows})
        datas.append(data)
        labels += fine
    _pickle(folder / "meta", {b"fine_label_names": [b"x"] * 100, b"coarse_label_names": [b"y"] * 20})
    return np.concatenate(datas), np.asarray(labels)


def make_targz(folder: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(folder, arcname=folder.name)
    return archive


def expected_images(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(((data.reshape(-1, 3, 32, 32) / 255.0 - 0.5) / 0.5).astype(np.float32))


def test_cifar10_extracted_folder_merges_train_then_test(tmp_path: Path) -> None:
    data, labels = write_cifar10(tmp_path)
    for where in (tmp_path, tmp_path / "cifar-10-batches-py"):  # contains the folder, or is it
        ds = load_dataset("cifar10", where)
        assert ds.x.dtype == torch.float32 and ds.x.shape == (24, 3, 32, 32) and ds.input_shape == (3, 32, 32)
        assert ds.num_classes == 10 and ds.vocab_size is None
        assert torch.equal(ds.y, torch.from_numpy(labels))
        torch.testing.assert_close(ds.x, expected_images(data))


def test_cifar_normalisation_maps_0_and_255_to_minus_one_and_one(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    obj = pickle.loads(batch.read_bytes(), encoding="bytes")
    obj[b"data"][0] = 0
    obj[b"data"][1] = 255
    obj[b"data"][2, :1024] = 255  # red plane only
    _pickle(batch, obj)
    x = load_cifar("cifar10", tmp_path).x
    assert torch.all(x[0] == -1) and torch.all(x[1] == 1)
    assert torch.all(x[2, 0] == 1) and x[2, 1:].shape == (2, 32, 32)


@pytest.mark.parametrize("pass_archive", [False, True])
def test_cifar10_targz_reads_like_the_extracted_folder(tmp_path: Path, pass_archive: bool) -> None:
    write_cifar10(tmp_path / "src")
    archive = make_targz(tmp_path / "src" / "cifar-10-batches-py", tmp_path / "cifar-10-python.tar.gz")
    folder_ds = load_dataset("cifar10", tmp_path / "src")
    tar_ds = load_dataset("cifar10", archive if pass_archive else tmp_path)
    assert torch.equal(folder_ds.x, tar_ds.x) and torch.equal(folder_ds.y, tar_ds.y)
    assert not (tmp_path / "cifar-10-batches-py").exists()  # never extracted to disk


def test_cifar100_fine_labels_from_folder_and_targz(tmp_path: Path) -> None:
    data, labels = write_cifar100(tmp_path / "src")
    make_targz(tmp_path / "src" / "cifar-100-python", tmp_path / "cifar-100-python.tar.gz")
    for where in (tmp_path / "src", tmp_path):
        ds = load_dataset("cifar100", where)
        assert ds.num_classes == 100 and ds.x.shape == (12, 3, 32, 32)
        assert torch.equal(ds.y, torch.from_numpy(labels))
        torch.testing.assert_close(ds.x, expected_images(data))


def test_cifar_truncated_pickle_names_the_file(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    bad = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    bad.write_bytes(bad.read_bytes()[:500])
    with pytest.raises(DataError, match="data_batch_3"):
        load_dataset("cifar10", tmp_path)


def test_cifar_truncated_or_garbage_archive_names_the_archive(tmp_path: Path) -> None:
    write_cifar10(tmp_path / "src", rows=40)
    archive = make_targz(tmp_path / "src" / "cifar-10-batches-py", tmp_path / "cifar-10-python.tar.gz")
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(DataError, match="cifar-10-python.tar.gz"):
        load_dataset("cifar10", tmp_path)
    archive.write_bytes(b"not a tar file at all" * 10)
    with pytest.raises(DataError, match="cifar-10-python.tar.gz"):
        load_dataset("cifar10", tmp_path)


def test_cifar_bad_labels_shapes_and_missing_files(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    obj = pickle.loads((folder / "test_batch").read_bytes(), encoding="bytes")
    _pickle(folder / "test_batch", {**obj, b"labels": [10] * 4})
    with pytest.raises(DataError, match=r"test_batch.*0\.\.9"):
        load_dataset("cifar10", tmp_path)
    _pickle(folder / "test_batch", {**obj, b"data": obj[b"data"][:, :100]})
    with pytest.raises(DataError, match=r"test_batch.*\[n, 3072\]"):
        load_dataset("cifar10", tmp_path)
    _pickle(folder / "test_batch", {**obj, b"labels": [1, 2]})
    with pytest.raises(DataError, match="test_batch"):
        load_dataset("cifar10", tmp_path)
    (folder / "data_batch_4").unlink()
    with pytest.raises(DataError, match="data_batch_4 is missing"):
        load_dataset("cifar10", tmp_path)
    with pytest.raises(DataError, match="cifar-10-python.tar.gz"):
        load_dataset("cifar10", tmp_path / "empty")
    with pytest.raises(DataError, match="needs data_dir"):
        load_dataset("cifar10")


def test_cifar_meta_of_the_other_variant_is_rejected(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    _pickle(tmp_path / "cifar-10-batches-py" / "batches.meta", {b"label_names": [b"a"] * 100})
    with pytest.raises(DataError, match="batches.meta"):
        load_dataset("cifar10", tmp_path)


def test_cifar_pickle_cannot_run_code(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_2").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(DataError, match=r"data_batch_2.*unexpected object"):
        load_dataset("cifar10", tmp_path)


# ---------------------------------------------------------------- Tiny-ImageNet

WNIDS = ["n03000000", "n01000000", "n02000000"]  # unsorted on purpose: labels follow the sorted order


def write_tiny(root: Path, per_class: int = 2) -> Path:
    """A tiny-imagenet-200 tree with solid-colour 64x64 JPEGs; the first image of n02000000 is grayscale."""
    tree = root / "tiny-imagenet-200"
    tree.mkdir(parents=True)
    (tree / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    for c, wnid in enumerate(sorted(WNIDS)):
        folder = tree / "train" / wnid / "images"
        folder.mkdir(parents=True)
        (tree / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
        for k in range(per_class):
            if wnid == "n02000000" and k == 0:
                img = Image.new("L", (64, 64), 200)
            else:
                img = Image.new("RGB", (64, 64), (40 * c, 100, 250 - 50 * k))
            img.save(folder / f"{wnid}_{k}.JPEG", quality=95)
    (tree / "val" / "images").mkdir(parents=True)
    lines = []
    for i, wnid in enumerate(["n03000000", "n01000000"]):
        Image.new("RGB", (64, 64), (0, 0, 255)).save(tree / "val" / "images" / f"val_{i}.JPEG", quality=95)
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    (tree / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return tree


def test_tiny_imagenet_train_only_labels_rgb_and_normalisation(tmp_path: Path) -> None:
    write_tiny(tmp_path)
    ds = load_dataset("tiny_imagenet", tmp_path)
    assert ds.x.dtype == torch.float32 and ds.x.shape == (6, 3, 64, 64) and ds.num_classes == 3
    assert ds.y.tolist() == [0, 0, 1, 1, 2, 2]  # sorted wnids, sorted file names
    gray = ds.x[2]  # n02000000_0: grayscale 200 -> three equal channels
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    torch.testing.assert_close(gray, torch.full_like(gray, (200 / 255 - 0.5) / 0.5), atol=0.03, rtol=0)
    expected = torch.tensor([(v / 255 - 0.5) / 0.5 for v in (0, 100, 250)])  # class 0, k=0
    torch.testing.assert_close(ds.x[0].mean(dim=(1, 2)), expected, atol=0.03, rtol=0)


def test_tiny_imagenet_include_val_and_tree_as_data_dir(tmp_path: Path) -> None:
    tree = write_tiny(tmp_path)
    ds = load_tiny_imagenet(tree, include_val=True)
    assert ds.x.shape == (8, 3, 64, 64) and ds.y.tolist()[-2:] == [2, 0]


def test_tiny_imagenet_cache_is_reused_and_invalidated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = write_tiny(tmp_path)
    first = load_tiny_imagenet(tmp_path)
    caches = list((tree / ".pflkit-cache").glob("tiny_imagenet-train-*.npy"))
    assert len(caches) == 1 and not list((tree / ".pflkit-cache").glob("*.part"))

    calls = []
    real_decode = tiny_module._decode
    monkeypatch.setattr(tiny_module, "_decode", lambda paths: calls.append(len(paths)) or real_decode(paths))
    again = load_tiny_imagenet(tmp_path)
    assert calls == [] and torch.equal(first.x, again.x) and torch.equal(first.y, again.y)

    Image.new("RGB", (64, 64), (1, 2, 3)).save(tree / "train" / "n01000000" / "images" / "n01000000_9.JPEG")
    grown = load_tiny_imagenet(tmp_path)
    assert calls == [7] and len(grown) == 7
    new_caches = list((tree / ".pflkit-cache").glob("tiny_imagenet-train-*.npy"))
    assert len(new_caches) == 1 and new_caches != caches  # the stale cache was replaced

    new_caches[0].write_bytes(b"garbage")  # a broken cache is ignored and rewritten
    assert torch.equal(load_tiny_imagenet(tmp_path).x, grown.x) and calls == [7, 7]

    load_tiny_imagenet(tmp_path, include_val=True, cache_dir=tmp_path / "elsewhere")
    assert len(list((tmp_path / "elsewhere").glob("tiny_imagenet-trainval-*.npy"))) == 1


def test_tiny_imagenet_corrupt_jpeg_wrong_size_and_missing_parts(tmp_path: Path) -> None:
    tree = write_tiny(tmp_path)
    bad = tree / "train" / "n02000000" / "images" / "n02000000_1.JPEG"
    good = bad.read_bytes()
    bad.write_bytes(good[: len(good) // 3])
    with pytest.raises(DataError, match="n02000000_1.JPEG"):
        load_tiny_imagenet(tmp_path)
    bad.write_bytes(b"\x00" * 100)
    with pytest.raises(DataError, match="n02000000_1.JPEG"):
        load_tiny_imagenet(tmp_path)
    Image.new("RGB", (32, 32)).save(bad, format="JPEG")
    with pytest.raises(DataError, match=r"n02000000_1.JPEG.*64x64"):
        load_tiny_imagenet(tmp_path)
    with pytest.raises(DataError, match="wnids.txt"):
        load_tiny_imagenet(tmp_path / "nowhere")
    (tree / "wnids.txt").write_text("\n".join(WNIDS + ["n09999999"]))
    with pytest.raises(DataError, match="n09999999"):
        load_tiny_imagenet(tmp_path)


# ---------------------------------------------------------------- AG News


def test_basic_english_matches_torchtext_rules() -> None:
    text = 'Hello, World! It\'s a "test" (really): yes; no. <br />End?'
    assert basic_english(text) == [
        "hello",
        ",",
        "world",
        "!",
        "it",
        "'",
        "s",
        "a",
        "test",
        "(",
        "really",
        ")",
        "yes",
        "no",
        ".",
        "end",
        "?",
    ]
    assert basic_english("  Wall St.\tBears\nClaw Back   ") == ["wall", "st", ".", "bears", "claw", "back"]
    assert basic_english("U.S. #39;s $5.2bn") == ["u", ".", "s", ".", "#39", "s", "$5", ".", "2bn"]
    assert basic_english("") == []


def _regex_basic_english(text: str) -> list[str]:
    """torchtext's rules as twelve sequential regex substitutions (the reference for the fast version)."""
    rules = [
        (r"'", " '  "),
        (r'"', ""),
        (r"\.", " . "),
        (r"<br \/>", " "),
        (r",", " , "),
        (r"\(", " ( "),
        (r"\)", " ) "),
        (r"\!", " ! "),
        (r"\?", " ? "),
        (r"\;", " "),
        (r"\:", " "),
        (r"\s+", " "),
    ]
    text = text.lower()
    for pattern, replacement in rules:
        text = re.sub(pattern, replacement, text)
    return text.split()


def test_basic_english_equals_the_sequential_regex_rules_on_random_text() -> None:
    rng = np.random.default_rng(0)
    alphabet = list("aZ'\".,()!?;:<>/ br\t\n\u00a0\u2003\u00c9#$-") + ["<br />", '<br "/>', "<BR />"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 30))))
        assert basic_english(text) == _regex_basic_english(text), repr(text)


def test_vocab_orders_by_frequency_then_alphabetically() -> None:
    vocab = build_vocab([["b", "a", "c", "a"], ["c", "b", "d"], ["<unk>", "e", "e", "e"]])
    assert vocab == {"<unk>": 0, "e": 1, "a": 2, "b": 3, "c": 4, "d": 5}


def test_encode_pads_and_truncates_with_zero() -> None:
    vocab = {"<unk>": 0, "a": 1, "b": 2}
    out = encode([["a", "b", "zzz"], ["b"] * 7], vocab, max_len=5)
    assert out.dtype == np.int64 and out.tolist() == [[1, 2, 0, 0, 0], [2, 2, 2, 2, 2]]


TRAIN_CSV = (
    '"3","Wall St. Bears Claw Back","Reuters - Short-sellers, Wall Street\'s dwindling band."\n'
    '"1","Title with ""quotes""","Text, with, commas"\n'
    '"4","Multi\nline","Second ""part"" here"\n'
)
TEST_CSV = '"2","Sports: win!","The team (finally) won; fans cheer"\n'


def write_agnews(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.csv").write_text(TRAIN_CSV, encoding="utf-8")
    (folder / "test.csv").write_text(TEST_CSV, encoding="utf-8")
    return folder


def test_agnews_loads_token_ids_labels_and_vocab(tmp_path: Path) -> None:
    write_agnews(tmp_path)
    ds = load_dataset("agnews", tmp_path)
    assert ds.x.dtype == torch.int64 and ds.x.shape == (4, 200) and ds.input_shape == (200,)
    assert ds.y.tolist() == [2, 0, 3, 1] and ds.num_classes == 4
    texts = [
        "Wall St. Bears Claw Back Reuters - Short-sellers, Wall Street's dwindling band.",
        'Title with "quotes" Text, with, commas',
        'Multi\nline Second "part" here',
        "Sports: win! The team (finally) won; fans cheer",
    ]
    tokens = [basic_english(t) for t in texts]
    vocab = build_vocab(tokens)
    assert ds.vocab_size == len(vocab)
    assert tokens[1] == ["title", "with", "quotes", "text", ",", "with", ",", "commas"]
    for row, toks in zip(ds.x, tokens):
        assert row[: len(toks)].tolist() == [vocab[t] for t in toks]
        assert torch.all(row[len(toks) :] == 0)
    assert vocab[","] == 1  # the most frequent token (4 times)


def test_agnews_truncates_to_200(tmp_path: Path) -> None:
    write_agnews(tmp_path)
    long_text = " ".join(f"w{i}" for i in range(300))
    (tmp_path / "test.csv").write_text(f'"2","t","{long_text}"\n')
    ds = load_agnews(tmp_path)
    assert ds.x.shape == (4, 200) and bool(torch.all(ds.x[3] > 0))


@pytest.mark.parametrize(
    "content, message",
    [
        ('"1","only two"\n', "row 1: expected 3 fields"),
        ('"1","a","b"\n"5","a","b"\n', "row 2: class index must be 1..4"),
        ('"x","a","b"\n', "class index"),
        ("", "holds no rows"),
    ],
)
def test_agnews_malformed_rows_name_the_file(tmp_path: Path, content: str, message: str) -> None:
    write_agnews(tmp_path)
    (tmp_path / "train.csv").write_text(content)
    with pytest.raises(DataError, match=message) as info:
        load_agnews(tmp_path)
    assert "train.csv" in str(info.value)


def test_agnews_missing_file_and_bad_encoding(tmp_path: Path) -> None:
    write_agnews(tmp_path)
    (tmp_path / "test.csv").write_bytes(b'"1","\xff\xfe","x"\n')
    with pytest.raises(DataError, match="test.csv"):
        load_agnews(tmp_path)
    (tmp_path / "test.csv").unlink()
    with pytest.raises(DataError, match="lacks test.csv.*pflkit download agnews"):
        load_agnews(tmp_path)


# ---------------------------------------------------------------- Dataset / FederatedData with token ids


def test_dataset_accepts_token_ids_with_vocab_size_only() -> None:
    ids, y = torch.tensor([[1, 2, 0], [3, 0, 0]]), torch.tensor([0, 1])
    assert Dataset("t", ids, y, 2, vocab_size=4).input_shape == (3,)
    with pytest.raises(ValueError, match="need vocab_size"):
        Dataset("t", ids, y, 2)
    with pytest.raises(ValueError, match=r"0\.\.2"):
        Dataset("t", ids, y, 2, vocab_size=3)
    with pytest.raises(ValueError, match="only for token ids"):
        Dataset("t", torch.zeros(2, 1, 4, 4), y, 2, vocab_size=3)
    with pytest.raises(ValueError, match=r"float32 \[n, C, H, W\] \(images\) or int64 \[n, L\]"):
        Dataset("t", torch.zeros(2, 3), y, 2)


def test_federated_data_carries_vocab_size(tmp_path: Path) -> None:
    write_agnews(tmp_path)
    ds = load_agnews(tmp_path)
    fed = FederatedData.build(ds, PartitionSpec(method="iid", num_clients=2, train_fraction=0.5), 0)
    assert fed.vocab_size == ds.vocab_size and fed.input_shape == (200,) and fed.x.dtype == torch.int64
    client = ClientData(0, ds.x[:2], ds.y[:2], ds.x[2:], ds.y[2:])
    assert FederatedData.from_clients([client], 4, vocab_size=7).vocab_size == 7
    assert FederatedData.from_clients([client], 4).vocab_size is None


# ---------------------------------------------------------------- PFLlib folders


def write_pfllib(
    root: Path, kind: str = "image", clients: int = 3, num_classes: int | None = 10, naming: str = "pfllib"
) -> Path:
    rng = np.random.default_rng(2)
    config = {
        "num_clients": clients,
        "non_iid": True,
        "balance": False,
        "partition": "dir",
        "alpha": 0.1,
        "batch_size": 10,
        "Size of samples for labels in clients": [],
    }
    if num_classes is not None:
        config["num_classes"] = num_classes
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    for split, n in (("train", 6), ("test", 2)):
        (root / split).mkdir()
        for i in range(clients):
            y = rng.integers(0, 10, size=n + i)
            if kind == "image":
                x = rng.normal(size=(n + i, 1, 16, 16)).astype(np.float32)
            else:
                ids = rng.integers(0, 50, size=(n + i, 12))
                ids[0, 0] = 63 if (split, i) == ("test", 2) else ids[0, 0]
                lens = np.full(n + i, 12)
                x = [(row, length) for row, length in zip(ids, lens)] if kind == "pairs" else (ids, lens)
            name = f"{i}.npz" if naming == "pfllib" else f"{split}{i}_.npz"  # FedALA repository
            with open(root / split / name, "wb") as fh:
                np.savez_compressed(fh, data={"x": x, "y": y})
    return root


def _npz(path: Path) -> dict:
    return np.load(path, allow_pickle=True)["data"].tolist()


def test_pfllib_images_keep_the_client_splits(tmp_path: Path) -> None:
    root = write_pfllib(tmp_path / "Cifar10")
    fed = load_pfllib(root)
    assert fed.num_clients == 3 and fed.num_classes == 10 and fed.input_shape == (1, 16, 16)
    assert fed.vocab_size is None and fed.dataset == "pfllib"
    for i, client in enumerate(fed.clients):
        train, test = _npz(root / "train" / f"{i}.npz"), _npz(root / "test" / f"{i}.npz")
        assert torch.equal(client.train_x, torch.from_numpy(train["x"]))
        assert client.train_y.tolist() == train["y"].tolist() and client.test_y.tolist() == test["y"].tolist()
        assert client.num_train == 6 + i and client.num_test == 2 + i
        assert torch.equal(fed.x[client.train_rows], client.train_x)
    assert fed.counts.sum() == sum(8 + 2 * i for i in range(3))


def test_pfllib_reads_the_fedala_repository_naming(tmp_path: Path) -> None:
    plain = load_pfllib(write_pfllib(tmp_path / "plain"))
    fedala = load_pfllib(write_pfllib(tmp_path / "fedala", naming="fedala"))
    assert [c.num_train for c in fedala.clients] == [6, 7, 8]
    for a, b in zip(plain.clients, fedala.clients):
        assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    root = tmp_path / "fedala"
    (root / "train" / "1.npz").write_bytes((root / "train" / "train1_.npz").read_bytes())
    with pytest.raises(DataError, match="two files for client 1: 1.npz and train1_.npz"):
        load_pfllib(root)


@pytest.mark.parametrize("kind", ["pairs", "tuple"])
def test_pfllib_text_takes_the_ids(tmp_path: Path, kind: str) -> None:
    root = write_pfllib(tmp_path / "agnews", kind=kind)
    fed = load_pfllib(root)
    assert fed.x.dtype == torch.int64 and fed.input_shape == (12,) and fed.vocab_size == 64
    assert fed.clients[2].test_x[0, 0] == 63


def test_pfllib_infers_num_classes_when_config_lacks_it(tmp_path: Path) -> None:
    root = write_pfllib(tmp_path / "d", num_classes=None)
    expected = max(int(_npz(p)["y"].max()) for p in root.glob("*/*.npz")) + 1
    assert load_pfllib(root).num_classes == expected


def test_pfllib_errors_name_the_problem(tmp_path: Path) -> None:
    root = write_pfllib(tmp_path / "d")
    (root / "test" / "1.npz").rename(tmp_path / "moved.npz")
    with pytest.raises(DataError, match=r"3 clients but .*test lacks the files of 1 of them \(1\.npz"):
        load_pfllib(root)
    (tmp_path / "moved.npz").rename(root / "test" / "1.npz")
    (root / "train" / "3.npz").write_bytes((root / "train" / "0.npz").read_bytes())
    with pytest.raises(DataError, match="3.npz: client count mismatch"):
        load_pfllib(root)
    (root / "train" / "3.npz").unlink()
    data = _npz(root / "train" / "1.npz")
    np.savez_compressed(root / "train" / "1.npz", data={**data, "y": data["y"] + 10})
    with pytest.raises(DataError, match=r"train/1\.npz: labels must be in 0\.\.9"):
        load_pfllib(root)
    (root / "train" / "1.npz").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"train/1\.npz is not a readable"):
        load_pfllib(root)
    (root / "config.json").write_text("{broken")
    with pytest.raises(DataError, match="config.json is not valid JSON"):
        load_pfllib(root)
    with pytest.raises(DataError, match="lacks config.json"):
        load_pfllib(tmp_path)
    with pytest.raises(DataError, match="load_pfllib"):
        load_dataset("pfllib", root)


def test_pfllib_experiment_adopts_the_folder_client_count(tmp_path: Path) -> None:
    root = write_pfllib(tmp_path / "d")
    config = build_config({"dataset": "pfllib", "data_dir": str(root), "num_clients": 20, "seeds": [0, 1]})
    adopted, partitions = build_partitions(config, torch.device("cpu"))
    assert adopted.partition.num_clients == 3 and set(partitions) == {0, 1}
    assert partitions[0] is partitions[1]
    assert adopted.model_for((1, 16, 16)) == "fedavg_cnn" and adopted.model_for((200,)) == "fasttext"


# ---------------------------------------------------------------- config, downloads, CLI


def test_config_file_datasets_need_data_dir_and_pick_models() -> None:
    for name in ("cifar10", "cifar100", "tiny_imagenet", "agnews", "pfllib"):
        with pytest.raises(ConfigError, match=f"dataset '{name}' needs data_dir"):
            build_config({"dataset": name})
    expected = {"cifar10": "fedavg_cnn", "cifar100": "fedavg_cnn", "tiny_imagenet": "fedavg_cnn", "agnews": "fasttext"}
    for name, model in expected.items():
        assert build_config({"dataset": name, "data_dir": "/x"}).resolved_model == model
    assert (
        build_config({"dataset": "pfllib", "data_dir": "/x", "model": "digits_cnn"}).model_for((200,)) == "digits_cnn"
    )


def test_fetch_verifies_and_writes_atomically(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload" * 1000)
    dest = tmp_path / "out" / "file.bin"
    with pytest.raises(DataError, match="does not match"):
        fetch([src.as_uri()], dest, md5_check("0" * 32))
    assert not dest.exists() and list(dest.parent.iterdir()) == []
    fetch(["file:///does/not/exist", src.as_uri()], dest, md5_check(md5sum(src)))
    assert dest.read_bytes() == src.read_bytes()


def test_download_cifar10_from_a_mirror_then_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_cifar10(tmp_path / "src")
    archive = make_targz(tmp_path / "src" / "cifar-10-batches-py", tmp_path / "cifar-10-python.tar.gz")
    monkeypatch.setattr(download_module, "_CIFAR_URL", tmp_path.as_uri() + "/")
    monkeypatch.setattr(download_module, "_CIFAR_MD5", {"cifar10": md5sum(archive)})
    target = tmp_path / "data"
    assert download("cifar10", target) == target
    assert (target / "cifar-10-python.tar.gz").is_file() and len(load_dataset("cifar10", target)) == 24


def test_download_unknown_names_fail_clearly(tmp_path: Path) -> None:
    for name in ("nope", "digits", "pfllib"):
        with pytest.raises(ValueError, match=f"no download for dataset '{name}'.*cifar10"):
            download(name, tmp_path)
    result = CliRunner().invoke(main, ["download", "nope", str(tmp_path)])
    assert result.exit_code == 2 and "no download for dataset 'nope'" in result.output


# ---------------------------------------------------------------- end to end


@pytest.mark.integration
def test_fedavg_runs_one_round_on_tiny_cifar(tmp_path: Path) -> None:
    write_cifar10(tmp_path / "cifar", rows=8)
    config = build_config(
        {
            "dataset": "cifar10",
            "data_dir": str(tmp_path / "cifar"),
            "num_clients": 2,
            "partition": "iid",
            "rounds": 1,
            "algorithms": ["fedavg"],
            "seeds": [0],
            "engine": "loop",
            "threads": 1,
            "batch_size": 8,
            "lr": 0.01,
        }
    )
    summary = run_experiment(config, tmp_path / "out", progress=False, echo=lambda _: None)
    assert set(summary) == {"fedavg"} and 0 <= summary["fedavg"]["final_accuracy"] <= 1
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "complete"


@pytest.mark.integration
def test_pfllib_folder_and_agnews_run_end_to_end(tmp_path: Path) -> None:
    from pflkit.models import MODELS

    common = {
        "num_clients": 2,
        "partition": "iid",
        "rounds": 1,
        "algorithms": ["fedavg"],
        "seeds": [0],
        "engine": "loop",
        "threads": 1,
        "batch_size": 4,
    }
    root = write_pfllib(tmp_path / "pfl")
    run_experiment(
        build_config({"dataset": "pfllib", "data_dir": str(root), **common}),
        tmp_path / "o1",
        progress=False,
        echo=lambda _: None,
    )
    assert "num_clients = 3" in (tmp_path / "o1" / "config.toml").read_text()  # the folder's count, adopted
    if "fasttext" not in MODELS:
        pytest.skip("the fasttext model is not registered")
    ag = write_agnews(tmp_path / "ag")
    (ag / "train.csv").write_text(TRAIN_CSV * 5)
    summary = run_experiment(
        build_config({"dataset": "agnews", "data_dir": str(ag), **common}),
        tmp_path / "o2",
        progress=False,
        echo=lambda _: None,
    )
    assert 0 <= summary["fedavg"]["final_accuracy"] <= 1

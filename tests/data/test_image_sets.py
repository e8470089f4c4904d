"""Fashion-MNIST, EMNIST, SVHN, USPS and CINIC-10 read from tiny files in their real formats,
written here (IDX, MATLAB v5, bz2 libsvm, PNG trees); downloads from local file:// mirrors."""

from __future__ import annotations

import bz2
import io
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from scipy.io import savemat

from pflkit.cli import main
from pflkit.config import build_config
from pflkit.data import DataError, download, load_dataset, write_idx
from pflkit.data import downloads as download_module
from pflkit.data.fetch import md5sum
from pflkit.data.idx_sets import EMNIST_CLASSES, emnist_files
from pflkit.federation.preparation import load_pool

FASHION = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def idx_set(folder: Path, names: tuple[str, ...], labels: tuple[int, int], n: int = 6, gz: bool = True) -> Path:
    """Four IDX files (train images/labels, test images/labels) with labels in ``labels``."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in (0, 2):
        count = n if i == 0 else n // 2
        suffix = ".gz" if gz else ""
        write_idx(folder / f"{names[i]}{suffix}", rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
        write_idx(folder / f"{names[i + 1]}{suffix}", rng.integers(labels[0], labels[1] + 1, count).astype(np.uint8))
    return folder


def test_fashion_mnist_reads_the_four_idx_files(tmp_path: Path) -> None:
    folder = idx_set(tmp_path / "fashion", FASHION, (0, 9))
    data = load_dataset("fashion_mnist", folder)
    assert data.x.shape == (9, 1, 28, 28) and data.official_train == 6 and data.num_classes == 10
    assert float(data.x.min()) >= -1 and float(data.x.max()) <= 1
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match=r"lacks t10k-labels-idx1-ubyte\[\.gz\].*pflkit download fashion_mnist"):
        load_dataset("fashion_mnist", folder)


def test_a_truncated_idx_file_is_one_line_naming_it(tmp_path: Path) -> None:
    folder = idx_set(tmp_path / "fashion", FASHION, (0, 9), gz=False)
    path = folder / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match="train-images-idx3-ubyte: IDX payload size mismatch \\(truncated\\)") as info:
        load_dataset("fashion_mnist", folder)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("split", sorted(EMNIST_CLASSES))
def test_emnist_splits_classes_and_upright_images(tmp_path: Path, split: str) -> None:
    low = 1 if split == "letters" else 0
    top = EMNIST_CLASSES[split] - 1 + low
    folder = idx_set(tmp_path / "emnist" / "gzip", emnist_files(split), (low, top))  # NIST's gzip/ layout
    data = load_dataset("emnist", tmp_path / "emnist", emnist_split=split)
    assert data.num_classes == EMNIST_CLASSES[split] and data.official_train == 6
    assert int(data.y.min()) >= 0 and int(data.y.max()) < data.num_classes
    from pflkit.data import read_idx

    stored = read_idx(folder / f"{emnist_files(split)[0]}.gz")[0]
    expected = (torch.from_numpy(stored.T.copy()).float() / 255 - 0.5) / 0.5  # EMNIST is stored transposed
    assert torch.allclose(data.x[0, 0], expected)


def test_emnist_split_is_a_config_key_and_bad_labels_are_named(tmp_path: Path) -> None:
    idx_set(tmp_path / "e", emnist_files("letters"), (1, 26))
    config = build_config({"dataset": "emnist", "data_dir": str(tmp_path / "e"), "data": {"emnist_split": "letters"}})
    assert load_pool(config).num_classes == 26 and config.resolved_model == "fedavg_cnn"
    idx_set(tmp_path / "d", emnist_files("digits"), (0, 12))
    with pytest.raises(DataError, match=r"labels-idx1-ubyte\.gz: labels must be in 0\.\.9, found \d+\.\.1[0-2]"):
        load_dataset("emnist", tmp_path / "d", emnist_split="digits")
    with pytest.raises(DataError, match=r"emnist \(balanced\): .* lacks emnist-balanced-train-images-idx3-ubyte"):
        load_dataset("emnist", tmp_path / "d")


def svhn_files(folder: Path) -> Path:
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train_32x32.mat", 5), ("test_32x32.mat", 3)):
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = np.array([[10], [1], [9], [10], [3]][:n], dtype=np.uint8)
        savemat(folder / name, {"X": x, "y": y})
    return folder


def test_svhn_mat_files_label_10_is_digit_0(tmp_path: Path) -> None:
    folder = svhn_files(tmp_path / "svhn")
    data = load_dataset("svhn", folder)
    assert data.x.shape == (8, 3, 32, 32) and data.official_train == 5
    assert data.y.tolist() == [0, 1, 9, 0, 3, 0, 1, 9]
    from scipy.io import loadmat

    raw = loadmat(folder / "train_32x32.mat")["X"][:, :, :, 1]  # [H, W, C]
    assert torch.allclose(data.x[1], (torch.from_numpy(raw).permute(2, 0, 1).float() / 255 - 0.5) / 0.5)
    path = folder / "test_32x32.mat"
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(DataError, match=r"test_32x32\.mat is not a readable MATLAB file \(truncated") as info:
        load_dataset("svhn", folder)
    assert "\n" not in str(info.value)


def usps_files(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = {
        "usps.bz2": ["1 1:-1 2:0.5 256:1", "10 3:0.25", "5 " + " ".join(f"{i}:-0.5" for i in range(1, 257))],
        "usps.t.bz2": ["3 7:1"],
    }
    for name, rows in lines.items():
        (folder / name).write_bytes(bz2.compress(("\n".join(rows) + "\n").encode()))
    return folder


def test_usps_libsvm_bz2_labels_shift_and_sparse_pixels(tmp_path: Path) -> None:
    folder = usps_files(tmp_path / "usps")
    data = load_dataset("usps", folder)
    assert data.x.shape == (4, 1, 16, 16) and data.y.tolist() == [0, 9, 4, 2] and data.official_train == 3
    flat = data.x.view(4, -1)
    assert flat[0, 0] == -1 and flat[0, 1] == 0.5 and flat[0, 255] == 1 and flat[0, 2] == 0  # left out: 0
    assert torch.all(flat[2] == -0.5) and flat[1, 2] == 0.25
    (folder / "usps.t.bz2").write_bytes((folder / "usps.t.bz2").read_bytes()[:20])
    with pytest.raises(DataError, match=r"usps\.t\.bz2 is not a readable libsvm file"):
        load_dataset("usps", folder)
    (folder / "usps.t.bz2").write_bytes(bz2.compress(b"3 300:1\n"))
    with pytest.raises(
        DataError, match=r"usps\.t\.bz2: line 1 is not 'label index:value \.\.\.' with indices 1\.\.256"
    ):
        load_dataset("usps", folder)


CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def cinic_tree(root: Path) -> Path:
    rng = np.random.default_rng(2)
    for split in ("train", "valid", "test"):
        for c, name in enumerate(CLASSES):
            (root / split / name).mkdir(parents=True)
            if c < 2:
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"cifar10-{split}-{c}.png")
    Image.fromarray(np.full((32, 32), 200, dtype=np.uint8)).save(root / "test" / "truck" / "n0001.png")  # grey
    return root


def test_cinic10_tree_pools_train_valid_then_test(tmp_path: Path) -> None:
    root = cinic_tree(tmp_path / "cinic" / "CINIC-10")
    data = load_dataset("cinic10", tmp_path / "cinic")
    assert data.x.shape == (7, 3, 32, 32) and data.official_train == 4
    assert data.y.tolist() == [0, 1, 0, 1, 0, 1, 9]
    grey = torch.full((3, 32, 32), (200 / 255 - 0.5) / 0.5)
    assert torch.allclose(data.x[-1], grey)
    png = root / "valid" / "automobile" / "cifar10-valid-1.png"
    png.write_bytes(png.read_bytes()[:60])
    with pytest.raises(DataError, match=r"cifar10-valid-1\.png is not a readable PNG image") as info:
        load_dataset("cinic10", root)
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="holds no train/, valid/ and test/ folders"):
        load_dataset("cinic10", tmp_path)


def test_downloads_from_mirrors_verify_and_extract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = idx_set(tmp_path / "src", FASHION, (0, 9))
    sums = {f"{n}.gz": md5sum(src / f"{n}.gz") for n in FASHION}
    monkeypatch.setattr(download_module, "_FASHION_URLS", ("file:///nowhere/", src.as_uri() + "/"))
    monkeypatch.setattr(download_module, "_FASHION_MD5", sums)
    assert len(load_dataset("fashion_mnist", download("fashion_mnist", tmp_path / "f"))) == 9
    monkeypatch.setattr(download_module, "_FASHION_MD5", {**sums, f"{FASHION[0]}.gz": "0" * 32})
    with pytest.raises(DataError, match="is already there but is not the expected file"):
        download("fashion_mnist", tmp_path / "f")

    gz = idx_set(tmp_path / "emnist-src" / "gzip", emnist_files("mnist"), (0, 9))
    archive = tmp_path / "gzip.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(gz.iterdir()):
            zf.write(path, f"gzip/{path.name}")
    monkeypatch.setattr(download_module, "_EMNIST_URL", archive.as_uri())
    monkeypatch.setattr(download_module, "_EMNIST_MD5", md5sum(archive))
    target = download("emnist", tmp_path / "e")
    assert not (target / "gzip.zip").exists() and len(load_dataset("emnist", target, emnist_split="mnist")) == 9

    tree = cinic_tree(tmp_path / "cinic-src")
    tar_path = tmp_path / "CINIC-10.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for split in ("train", "valid", "test"):
            tar.add(tree / split, arcname=split)
    monkeypatch.setattr(download_module, "_CINIC_URL", tar_path.as_uri())
    target = download("cinic10", tmp_path / "c")
    assert (target / "CINIC-10" / "test" / "truck").is_dir() and len(load_dataset("cinic10", target)) == 7
    bad = tmp_path / "bad"
    bad.mkdir()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("README")
        tar.addfile(info, io.BytesIO(b""))
    (bad / "CINIC-10.tar.gz").write_bytes(buffer.getvalue())
    with pytest.raises(DataError, match="lacks train/, valid/ and test/"):
        download("cinic10", bad)


def test_svhn_and_usps_downloads_verify_their_md5_sums(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, files, url_attr, md5_attr, size in (
        ("svhn", svhn_files(tmp_path / "svhn-src"), "_SVHN_URL", "_SVHN_MD5", 8),
        ("usps", usps_files(tmp_path / "usps-src"), "_USPS_URL", "_USPS_MD5", 4),
    ):
        sums = {path.name: md5sum(path) for path in files.iterdir()}
        monkeypatch.setattr(download_module, url_attr, files.as_uri() + "/")
        monkeypatch.setattr(download_module, md5_attr, sums)
        target = download(name, tmp_path / name)
        assert sorted(p.name for p in target.iterdir()) == sorted(sums) and len(load_dataset(name, target)) == size
        first = sorted(sums)[0]
        monkeypatch.setattr(download_module, md5_attr, {**sums, first: "0" * 32})
        with pytest.raises(DataError, match=f"{first} is already there but is not the expected file"):
            download(name, tmp_path / name)
        with pytest.raises(DataError, match=first):  # a fresh folder: the fetched file fails its sum
            download(name, tmp_path / f"{name}-fresh")


def test_new_pool_datasets_need_data_dir_and_pick_models() -> None:
    for name in ("fashion_mnist", "emnist", "svhn", "usps", "cinic10"):
        with pytest.raises(Exception, match=f"dataset '{name}' needs data_dir.*pflkit download {name}"):
            build_config({"dataset": name})
        assert build_config({"dataset": name, "data_dir": "/x"}).resolved_model == "fedavg_cnn"


@pytest.mark.integration
def test_cli_runs_lenet5_on_tiny_fashion_mnist(tmp_path: Path) -> None:
    folder = idx_set(tmp_path / "fashion", FASHION, (0, 9), n=40)
    args = ["run", "dataset=fashion_mnist", f"data_dir={folder}", "model=lenet5", "num_clients=2", "partition=iid"]
    args += [
        "rounds=2",
        'algorithms=["fedavg"]',
        "engine=loop",
        "batch_size=4",
        "--quiet",
        "--out",
        str(tmp_path / "o"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output

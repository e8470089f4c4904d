"""Centralised datasets as tensors (normalised images or token ids), before any federated split.

FedALA pools the official train and test sets and partitions the pool (as PFLlib's
``dataset/generate_*.py`` scripts do), so every loader here returns one pool of samples
(:class:`Dataset`, in dataset.py). This module reads the built-in sets (digits, synthetic,
MNIST) and dispatches by name (:func:`load_dataset`) to the readers of the other datasets, which
live in their own modules (cifar, tiny_imagenet, agnews).
"""

from __future__ import annotations

import functools
import os
import re
from functools import partial
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch

from pflkit.data.agnews import load_agnews
from pflkit.data.cifar import load_cifar
from pflkit.data.cinic import load_cinic10
from pflkit.data.dataset import Dataset
from pflkit.data.digit_sets import load_svhn, load_usps
from pflkit.data.errors import DataError
from pflkit.data.fetch import check_present, fetch, md5_check
from pflkit.data.idx import read_idx
from pflkit.data.idx_sets import load_emnist, load_fashion_mnist
from pflkit.data.tiny_imagenet import load_tiny_imagenet

__all__ = ["DATASETS", "FILE_DATASETS", "DatasetName", "download_mnist", "load_dataset"]

# What data_dir must hold for each dataset read from files (config validation and error messages).
FILE_DATASETS: dict[str, str] = {
    "mnist": "the four MNIST IDX files (plain or .gz)",
    "cifar10": "cifar-10-batches-py/ or cifar-10-python.tar.gz",
    "cifar100": "cifar-100-python/ or cifar-100-python.tar.gz",
    "tiny_imagenet": "the tiny-imagenet-200/ tree (wnids.txt, train/, val/)",
    "agnews": "the AG News train.csv and test.csv",
    "fashion_mnist": "the four Fashion-MNIST IDX files (MNIST's names, plain or .gz)",
    "emnist": "the EMNIST IDX files emnist-<split>-{train,test}-{images,labels}-*-ubyte[.gz] (or gzip/ with them)",
    "svhn": "SVHN's train_32x32.mat and test_32x32.mat",
    "usps": "USPS's usps.bz2 and usps.t.bz2 (libsvm format)",
    "cinic10": "the CINIC-10 tree train/, valid/, test/ of <class>/*.png",
    "pfllib": "a PFLlib dataset folder (config.json, train/<i>.npz, test/<i>.npz)",
    "femnist": "LEAF's FEMNIST JSON files (train/*.json, test/*.json)",
    "shakespeare": "LEAF's Shakespeare JSON files (train/*.json, test/*.json)",
    "sent140": "LEAF's Sent140 JSON files (train/*.json, test/*.json)",
    "leaf": "a numeric set in LEAF's JSON format (train/*.json, test/*.json; pFedMe's MNIST or Synthetic)",
    "digit5": "FedBN's Digit-5 folders MNIST/, SVHN/, USPS/, SynthDigits/, MNIST_M/ "
    "(partitions/train_part<k>.pkl, test.pkl)",
    "office_caltech10": "the Office-Caltech-10 tree <domain>/<class>/*.jpg (amazon, caltech, dslr, webcam)",
    "domainnet": "the DomainNet tree <domain>/<class>/*.jpg with <domain>_train.txt and <domain>_test.txt",
}
DatasetName = Literal[
    "digits",
    "mnist",
    "synthetic",
    "cifar10",
    "cifar100",
    "tiny_imagenet",
    "agnews",
    "fashion_mnist",
    "emnist",
    "svhn",
    "usps",
    "cinic10",
    "pfllib",
    "femnist",
    "shakespeare",
    "sent140",
    "leaf",
    "fedprox_synthetic",
    "digit5",
    "office_caltech10",
    "domainnet",
]
DATASETS: tuple[str, ...] = get_args(DatasetName)


def _normalize_unit(x: np.ndarray) -> torch.Tensor:
    """Map values in [0, 1] to [-1, 1], i.e. torchvision's Normalize(0.5, 0.5)."""
    return torch.from_numpy(((x - 0.5) / 0.5).astype(np.float32))


def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images.astype(np.float64) / 16.0
    x = _normalize_unit(images[:, None, :, :])
    y = torch.from_numpy(bunch.target.astype(np.int64))
    return Dataset("digits", x, y, 10)


_SYNTHETIC_SEED = 20220607
_SYNTHETIC_PER_CLASS = 100
_SYNTHETIC_CLASSES = 10


def _load_synthetic() -> Dataset:
    # Own Generator with a fixed seed: the result never depends on global RNG state.
    rng = np.random.default_rng(_SYNTHETIC_SEED)
    means = rng.normal(0.0, 0.5, size=(_SYNTHETIC_CLASSES, 1, 8, 8))
    y = np.repeat(np.arange(_SYNTHETIC_CLASSES), _SYNTHETIC_PER_CLASS)
    y = y[rng.permutation(len(y))]
    x = means[y] + rng.normal(0.0, 0.5, size=(len(y), 1, 8, 8))
    return Dataset(
        "synthetic",
        torch.from_numpy(x.astype(np.float32)),
        torch.from_numpy(y.astype(np.int64)),
        _SYNTHETIC_CLASSES,
    )


_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def _find_mnist_files(data_dir: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    missing: list[str] = []
    for base in _MNIST_FILES:
        # Prefer the extracted file when both exist: it reads faster.
        for candidate in (data_dir / base, data_dir / f"{base}.gz"):
            if candidate.is_file():
                found[base] = candidate
                break
        else:
            missing.append(base)
    if missing:
        expected = ", ".join(f"{b}[.gz]" for b in _MNIST_FILES)
        raise DataError(
            f"MNIST directory {data_dir} lacks {', '.join(f'{m}[.gz]' for m in missing)}; "
            f"expected all of: {expected}. Fetch them with: pflkit download mnist {data_dir}"
        )
    return found


def _read_mnist_split(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise DataError(f"{images_path}: expected uint8 images of shape [n, 28, 28], got {images.dtype} {images.shape}")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise DataError(f"{labels_path}: expected uint8 labels of shape [n], got {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise DataError(f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels")
    if labels.size and labels.max() > 9:
        raise DataError(f"{labels_path}: labels must be in 0..9, found {int(labels.max())}")
    return images, labels


def _load_mnist(data_dir: str | Path | None) -> Dataset:
    if data_dir is None:
        raise DataError(
            "MNIST needs data_dir: a directory holding the four IDX files "
            f"({', '.join(_MNIST_FILES)}, plain or .gz); "
            "set data_dir, or fetch them with: pflkit download mnist DIR"
        )
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(
            f"MNIST directory {data_dir} does not exist; expected it to hold "
            f"{', '.join(_MNIST_FILES)} (plain or .gz). "
            f"Fetch them with: pflkit download mnist {data_dir}"
        )
    files = _find_mnist_files(data_dir)
    train_x, train_y = _read_mnist_split(files[_MNIST_FILES[0]], files[_MNIST_FILES[1]])
    test_x, test_y = _read_mnist_split(files[_MNIST_FILES[2]], files[_MNIST_FILES[3]])

    n = len(train_y) + len(test_y)
    x = torch.empty((n, 1, 28, 28), dtype=torch.float32)
    # Fill in place to avoid float64 temporaries of the whole pool (70k x 784).
    x[: len(train_y), 0] = torch.from_numpy(train_x)
    x[len(train_y) :, 0] = torch.from_numpy(test_x)
    x.div_(255.0).sub_(0.5).div_(0.5)
    y = torch.from_numpy(np.concatenate([train_y, test_y]).astype(np.int64))
    return Dataset("mnist", x, y, 10, official_train=len(train_y))


def _require_dir(name: str, data_dir: str | Path | None) -> Path:
    if data_dir is None:
        raise DataError(
            f"dataset {name!r} needs data_dir: {FILE_DATASETS[name]}; fetch it with: pflkit download {name} DIR"
        )
    return Path(data_dir)


def data_folder(data_dir: str | Path) -> Path:
    """``data_dir`` with ``~`` and environment variables expanded (``${PFLKIT_DATA}/mnist``: configs that
    name no machine's path, as the committed result cells do); an unset variable is an error."""
    text = os.path.expandvars(os.path.expanduser(str(data_dir)))
    unset = re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text)
    if unset:
        raise DataError(
            f"data_dir {str(data_dir)!r} names the environment variable {unset[0]}, which is not set; "
            f"set it to the folder that holds the datasets (e.g. export {unset[0]}=/path/to/datasets) "
            "or give data_dir=DIR"
        )
    return Path(text)


def load_dataset(
    name: str, data_dir: str | Path | None = None, *, official_test: bool = False, emnist_split: str = "balanced"
) -> Dataset:
    """Load a dataset by name (see :data:`DATASETS`) as one pool (train and test merged).

    ``data_dir`` is needed only for file-based datasets (:data:`FILE_DATASETS`).
    ``official_test`` asks for the official test split too where a loader leaves it out by
    default (Tiny-ImageNet's val images, which FedALA does not use).
    ``emnist_split``: the EMNIST split that ``"emnist"`` reads.
    The datasets with their own clients (``"pfllib"``, LEAF's, ``"fedprox_synthetic"``) are read
    with :func:`pflkit.data.load_clients`.
    """
    if data_dir is not None:
        data_dir = data_folder(data_dir)
    if name == "digits":
        return _load_digits()
    if name == "mnist":
        return _load_mnist(data_dir)
    if name == "synthetic":
        return _load_synthetic()
    if name in ("cifar10", "cifar100"):
        return load_cifar(name, _require_dir(name, data_dir))
    if name == "tiny_imagenet":
        return load_tiny_imagenet(_require_dir(name, data_dir), include_val=official_test)
    if name == "agnews":
        return load_agnews(_require_dir(name, data_dir))
    readers = {"fashion_mnist": load_fashion_mnist, "svhn": load_svhn, "usps": load_usps, "cinic10": load_cinic10}
    if name in readers:
        return readers[name](_require_dir(name, data_dir))
    if name == "emnist":
        return load_emnist(_require_dir(name, data_dir), emnist_split)
    from .natural import NATURAL_DATASETS  # (natural's readers import this module)

    if name in NATURAL_DATASETS:
        raise DataError(
            f"dataset {name!r} holds per-client splits, not one pool: "
            f'run it with dataset = "{name}" (its clients are adopted) or read it with '
            "pflkit.data.load_clients (pflkit.data.load_pfllib for PFLlib folders)"
        )
    raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")


_MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
# Official md5 sums. The train-images sum (f68b3c2dcbeaaa9fbdd348bbdeb94873) is not
# enforced: equivalent re-packed copies exist, so that file is checked by header instead.
_MNIST_MD5 = {
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}


def _verify_download(tmp: Path, filename: str) -> None:
    expected = _MNIST_MD5.get(filename)
    if expected is not None:
        md5_check(expected)(tmp)
        return
    images = read_idx(tmp)
    if images.dtype != np.uint8 or images.shape != (60000, 28, 28):
        raise DataError(f"{filename}: expected 60000 uint8 images of 28x28, got {images.dtype} {images.shape}")


#: the shape of each MNIST file's array
_MNIST_SHAPES = {
    "train-images-idx3-ubyte": (60000, 28, 28),
    "train-labels-idx1-ubyte": (60000,),
    "t10k-images-idx3-ubyte": (10000, 28, 28),
    "t10k-labels-idx1-ubyte": (10000,),
}


def _check_mnist_file(path: Path, base: str) -> None:
    """An MNIST file in place (plain or .gz) holds the official array's shape and dtype."""
    array = read_idx(path)
    if array.dtype != np.uint8 or array.shape != _MNIST_SHAPES[base]:
        raise DataError(f"expected uint8 {_MNIST_SHAPES[base]}, got {array.dtype} {array.shape}")


def download_mnist(data_dir: str | Path) -> Path:
    """Download the four official MNIST ``.gz`` files into ``data_dir`` and return it.

    Files already present (plain or ``.gz``) are checked, not fetched again. Each download goes to a
    temporary file that is verified and then renamed, so an interrupted run never
    leaves a partial file under the final name.
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    missing: list[str] = []
    for base in _MNIST_FILES:  # every file already there is checked before anything is fetched
        present = [path for path in (data_dir / base, data_dir / f"{base}.gz") if path.is_file()]
        for path in present:
            check_present(path, partial(_check_mnist_file, base=base))
        if not present:
            missing.append(base)
    for base in missing:
        filename = f"{base}.gz"
        fetch(
            [mirror + filename for mirror in _MNIST_MIRRORS],
            data_dir / filename,
            functools.partial(_verify_download, filename=filename),
        )
    return data_dir

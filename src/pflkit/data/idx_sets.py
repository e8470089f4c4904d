"""Fashion-MNIST and EMNIST from their IDX files (MNIST's format, plain or .gz), one pool each with
the official training split first.

* Fashion-MNIST: ``train-images-idx3-ubyte`` ... ``t10k-labels-idx1-ubyte`` (MNIST's four names), 10 classes.
* EMNIST: ``emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte`` in ``data_dir`` or its
  ``gzip/`` folder (the layout of NIST's ``gzip.zip``), for the splits byclass (62 classes),
  bymerge (47), balanced (47), letters (26: its labels 1..26 are read as 0..25), digits and mnist
  (10). EMNIST stores every image transposed relative to MNIST; it is transposed back, so that
  its digits stand upright as MNIST's do.

Images are normalised as ``(x / 255 - 0.5) / 0.5``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pflkit.data.dataset import Dataset
from pflkit.data.errors import DataError
from pflkit.data.idx import read_idx

__all__ = ["EMNIST_CLASSES", "EMNIST_SPLITS", "emnist_files", "load_emnist", "load_fashion_mnist"]

FASHION_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_EMNIST_PARTS = ("train-images-idx3", "train-labels-idx1", "test-images-idx3", "test-labels-idx1")
#: split -> number of classes (letters: its labels 1..26 become 0..25)
EMNIST_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}
EMNIST_SPLITS = tuple(EMNIST_CLASSES)


def emnist_files(split: str) -> tuple[str, ...]:
    """The four IDX file names of an EMNIST split (train images, train labels, test images, test labels)."""
    return tuple(f"emnist-{split}-{part}-ubyte" for part in _EMNIST_PARTS)


def _find(folders: list[Path], names: tuple[str, ...], dataset: str, download: str) -> list[Path]:
    found, missing = [], []
    for name in names:
        candidates = [f / n for f in folders for n in (name, f"{name}.gz")]
        hit = next((c for c in candidates if c.is_file()), None)
        if hit is None:
            missing.append(f"{name}[.gz]")
        else:
            found.append(hit)
    if missing:
        raise DataError(
            f"{dataset}: {folders[0]} lacks {', '.join(missing)}; fetch the files with: pflkit download {download}"
        )
    return found


def _read_pair(images_path: Path, labels_path: Path, num_classes: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise DataError(f"{images_path}: expected uint8 images of shape [n, 28, 28], got {images.dtype} {images.shape}")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise DataError(f"{labels_path}: expected uint8 labels of shape [n], got {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise DataError(f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels")
    labels = labels.astype(np.int64) - offset
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(
            f"{labels_path}: labels must be in {offset}..{num_classes - 1 + offset}, "
            f"found {labels.min() + offset}..{labels.max() + offset}"
        )
    return images, labels


def _pool(name: str, paths: list[Path], num_classes: int, offset: int = 0, transpose: bool = False) -> Dataset:
    train_x, train_y = _read_pair(paths[0], paths[1], num_classes, offset)
    test_x, test_y = _read_pair(paths[2], paths[3], num_classes, offset)
    images = np.concatenate([train_x, test_x])
    if transpose:
        images = images.transpose(0, 2, 1)
    x = torch.from_numpy(np.ascontiguousarray(images)).unsqueeze(1).float()
    x.div_(255.0).sub_(0.5).div_(0.5)
    y = torch.from_numpy(np.concatenate([train_y, test_y]))
    return Dataset(name, x, y, num_classes, official_train=len(train_y))


def load_fashion_mnist(data_dir: str | Path) -> Dataset:
    """Fashion-MNIST's four IDX files in ``data_dir`` as one normalised pool [n, 1, 28, 28]."""
    folder = Path(data_dir)
    return _pool("fashion_mnist", _find([folder], FASHION_FILES, "fashion_mnist", f"fashion_mnist {folder}"), 10)


def load_emnist(data_dir: str | Path, split: str = "balanced") -> Dataset:
    """EMNIST ``split`` (see :data:`EMNIST_CLASSES`) from ``data_dir`` or ``data_dir/gzip`` as one
    normalised pool of upright images [n, 1, 28, 28]."""
    if split not in EMNIST_CLASSES:
        raise ValueError(f"unknown EMNIST split {split!r}; available: {', '.join(EMNIST_SPLITS)}")
    folder = Path(data_dir)
    paths = _find([folder, folder / "gzip"], emnist_files(split), f"emnist ({split})", f"emnist {folder}")
    return _pool("emnist", paths, EMNIST_CLASSES[split], offset=1 if split == "letters" else 0, transpose=True)

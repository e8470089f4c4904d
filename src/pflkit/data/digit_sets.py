"""SVHN (``train_32x32.mat`` / ``test_32x32.mat``) and USPS (the bz2 libsvm files ``usps.bz2`` /
``usps.t.bz2`` that torchvision reads), each one pool with the official training split first.

* SVHN: MATLAB files read with ``scipy.io.loadmat``: ``X`` uint8 [32, 32, 3, n], ``y`` [n, 1] in
  1..10, where 10 means the digit 0; images [3, 32, 32] normalised as ``(x / 255 - 0.5) / 0.5``.
* USPS: one sample a line, ``label index:value ...`` with labels 1..10 (the digit + 1) and 256
  values in [-1, 1] (16x16 pixels, indices 1..256; an index left out is 0, the libsvm
  convention); images [1, 16, 16] kept in [-1, 1]. The files may also lie uncompressed
  (``usps``, ``usps.t``).
"""

from __future__ import annotations

import bz2
from pathlib import Path

import numpy as np
import torch

from pflkit.data.dataset import Dataset
from pflkit.data.errors import DataError

__all__ = ["SVHN_FILES", "USPS_FILES", "load_svhn", "load_usps", "read_libsvm"]

SVHN_FILES = ("train_32x32.mat", "test_32x32.mat")
USPS_FILES = ("usps.bz2", "usps.t.bz2")
USPS_SIDE = 16


def _svhn_split(path: Path) -> tuple[np.ndarray, np.ndarray]:
    from scipy.io import loadmat

    if not path.is_file():
        raise DataError(
            f"SVHN: {path} is missing (expected {' and '.join(SVHN_FILES)}); fetch: pflkit download svhn DIR"
        )
    try:
        mat = loadmat(path, variable_names=["X", "y"])
    except Exception as exc:  # noqa: BLE001 - scipy raises many kinds on a broken file
        raise DataError(f"{path} is not a readable MATLAB file (truncated or corrupt?): {exc}") from None
    x, y = mat.get("X"), mat.get("y")
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        shape = getattr(x, "shape", None)
        raise DataError(f"{path}: X must be uint8 [32, 32, 3, n], got {getattr(x, 'dtype', None)} {shape}")
    if not isinstance(y, np.ndarray) or y.size != x.shape[3]:
        raise DataError(f"{path}: y must hold one label per image ({x.shape[3]}), got {getattr(y, 'shape', None)}")
    labels = y.reshape(-1).astype(np.int64)
    if labels.size and (labels.min() < 1 or labels.max() > 10):
        raise DataError(f"{path}: labels must be in 1..10 (10 = digit 0), found {labels.min()}..{labels.max()}")
    return x.transpose(3, 2, 0, 1), labels % 10


def load_svhn(data_dir: str | Path) -> Dataset:
    """SVHN's ``train_32x32.mat`` and ``test_32x32.mat`` in ``data_dir`` as one normalised pool."""
    parts = [_svhn_split(Path(data_dir) / name) for name in SVHN_FILES]
    x = torch.from_numpy(np.ascontiguousarray(np.concatenate([p[0] for p in parts]))).float()
    x.div_(255.0).sub_(0.5).div_(0.5)
    y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    return Dataset("svhn", x, y, 10, official_train=len(parts[0][1]))


def read_libsvm(path: Path, features: int) -> tuple[np.ndarray, np.ndarray]:
    """A libsvm text file (plain or .bz2): (float32 [n, features], int64 labels)."""
    try:
        raw = path.read_bytes()
        text = (bz2.decompress(raw) if raw[:3] == b"BZh" else raw).decode("ascii")
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"{path} is not a readable libsvm file (truncated or corrupt bz2?): {exc}") from None
    rows, labels = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        row = np.zeros(features, dtype=np.float32)
        try:
            labels.append(int(float(fields[0])))
            for field in fields[1:]:
                index, value = field.split(":")
                if not 1 <= int(index) <= features:
                    raise ValueError(f"index {index}")
                row[int(index) - 1] = float(value)
        except (ValueError, IndexError) as exc:
            raise DataError(
                f"{path}: line {number} is not 'label index:value ...' with indices 1..{features} ({exc})"
            ) from None
        rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no samples")
    return np.stack(rows), np.asarray(labels, dtype=np.int64)


def _usps_file(folder: Path, name: str) -> Path:
    for candidate in (folder / name, folder / name.removesuffix(".bz2")):
        if candidate.is_file():
            return candidate
    raise DataError(f"USPS: {folder} lacks {name} (or {name.removesuffix('.bz2')}); fetch: pflkit download usps DIR")


def load_usps(data_dir: str | Path) -> Dataset:
    """USPS's libsvm files in ``data_dir`` as one pool of [1, 16, 16] images in [-1, 1]."""
    parts = []
    for name in USPS_FILES:
        path = _usps_file(Path(data_dir), name)
        x, y = read_libsvm(path, USPS_SIDE * USPS_SIDE)
        if y.min() < 1 or y.max() > 10:
            raise DataError(f"{path}: USPS labels must be in 1..10 (the digit + 1), found {y.min()}..{y.max()}")
        if x.min() < -1 or x.max() > 1:
            raise DataError(f"{path}: USPS pixel values must be in [-1, 1], found {x.min()}..{x.max()}")
        parts.append((x.reshape(-1, 1, USPS_SIDE, USPS_SIDE), y - 1))
    images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    return Dataset("usps", images, labels, 10, official_train=len(parts[0][1]))

"""CINIC-10 from its folder tree ``train/``, ``valid/``, ``test/``, each with one folder of 32x32
PNG images per class (in ``data_dir`` or ``data_dir/CINIC-10``), as one pool.

The classes are CIFAR-10's ten, in alphabetical order (the folder names); train and valid come
first and form the official training split, test the official test split. Grey images (some
CINIC-10 images from ImageNet are) are read as RGB; images are normalised as ``(x / 255 - 0.5) / 0.5``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pflkit.data.dataset import Dataset
from pflkit.data.errors import DataError

__all__ = ["CINIC_CLASSES", "CINIC_SPLITS", "load_cinic10"]

CINIC_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CINIC_SPLITS = ("train", "valid", "test")
SIDE = 32


def _root(data_dir: Path) -> Path:
    for root in (data_dir, data_dir / "CINIC-10"):
        if all((root / split).is_dir() for split in CINIC_SPLITS):
            return root
    raise DataError(
        f"CINIC-10: {data_dir} holds no train/, valid/ and test/ folders (nor CINIC-10/ with them); "
        f"fetch it with: pflkit download cinic10 {data_dir}"
    )


def _split(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image, UnidentifiedImageError

    found = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if tuple(found) != CINIC_CLASSES:
        raise DataError(f"{folder}: expected the class folders {', '.join(CINIC_CLASSES)}, found {', '.join(found)}")
    images, labels = [], []
    for label, name in enumerate(CINIC_CLASSES):
        for path in sorted((folder / name).glob("*.png")):
            try:
                with Image.open(path) as img:
                    arr = np.asarray(img.convert("RGB"))
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
                raise DataError(f"{path} is not a readable PNG image (corrupt or truncated?): {exc}") from None
            if arr.shape != (SIDE, SIDE, 3):
                raise DataError(f"{path}: expected a {SIDE}x{SIDE} image, got {arr.shape[1]}x{arr.shape[0]}")
            images.append(arr.transpose(2, 0, 1))
            labels.append(label)
    if not images:
        raise DataError(f"{folder} holds no .png images")
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def load_cinic10(data_dir: str | Path) -> Dataset:
    """CINIC-10's train, valid and test images as one normalised pool [n, 3, 32, 32]."""
    root = _root(Path(data_dir))
    parts = [_split(root / split) for split in CINIC_SPLITS]
    x = torch.from_numpy(np.concatenate([p[0] for p in parts])).float()
    x.div_(255.0).sub_(0.5).div_(0.5)
    y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    return Dataset("cinic10", x, y, 10, official_train=len(parts[0][1]) + len(parts[1][1]))

"""Tiny-ImageNet-200 from its standard ``tiny-imagenet-200`` folder tree.

FedALA partitions only the 100k training images; ``include_val``
appends the 10k labelled validation images. Labels follow torchvision's
ImageFolder (as PFLlib): the index of the wnid in the *sorted* wnid list, and
within a class the images are in sorted file-name order. Images are converted
to RGB (some are grayscale) and normalised as ``(x / 255 - 0.5) / 0.5``.

Decoding 100k JPEGs takes a while, so the decoded uint8 array is cached as a
``.npy`` file (by default in ``<tiny-imagenet-200>/.pflkit-cache/``). The cache
name holds a hash of the file list (relative paths, sizes, labels), so any
change to the images makes a new cache; stale caches of the same split are
removed. An unwritable cache location only costs the speed-up (a warning).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from pflkit.data.dataset import Dataset
from pflkit.data.errors import DataError

__all__ = ["load_tiny_imagenet"]

log = logging.getLogger(__name__)

FOLDER = "tiny-imagenet-200"
SIDE = 64


def _root(data_dir: Path) -> Path:
    for candidate in (data_dir / FOLDER, data_dir):
        if (candidate / "wnids.txt").is_file():
            return candidate
    raise DataError(
        f"tiny_imagenet: neither {data_dir / FOLDER} nor {data_dir} holds wnids.txt; expected the "
        f"{FOLDER}/ tree (fetch it with: pflkit download tiny_imagenet {data_dir})"
    )


def _listing(root: Path, include_val: bool) -> tuple[list[Path], np.ndarray, list[str]]:
    """Image paths, their labels and the sorted wnids."""
    wnids_path = root / "wnids.txt"
    try:
        wnids = sorted({line.strip() for line in wnids_path.read_text().splitlines() if line.strip()})
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{wnids_path} cannot be read as text: {exc}") from exc
    if not wnids:
        raise DataError(f"{wnids_path} lists no classes")
    index = {w: i for i, w in enumerate(wnids)}
    paths: list[Path] = []
    labels: list[int] = []
    for wnid in wnids:
        folder = root / "train" / wnid / "images"
        if not folder.is_dir():
            raise DataError(f"{folder} is missing (class {wnid} of {wnids_path})")
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpeg", ".jpg"))
        if not files:
            raise DataError(f"{folder} holds no .JPEG images")
        paths += files
        labels += [index[wnid]] * len(files)
    if include_val:
        ann = root / "val" / "val_annotations.txt"
        if not ann.is_file():
            raise DataError(f"{ann} is missing (needed for include_val=True)")
        for lineno, line in enumerate(ann.read_text().splitlines(), 1):
            fields = line.split("\t")
            if not line.strip():
                continue
            if len(fields) < 2 or fields[1] not in index:
                raise DataError(
                    f"{ann}, line {lineno}: expected '<file>\\t<wnid>...' with a wnid of wnids.txt, got {line[:80]!r}"
                )
            paths.append(root / "val" / "images" / fields[0])
            labels.append(index[fields[1]])
    return paths, np.asarray(labels, dtype=np.int64), wnids


def _decode(paths: list[Path]) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    out = np.empty((len(paths), 3, SIDE, SIDE), dtype=np.uint8)
    log.info("decoding %d Tiny-ImageNet images (cached for later runs)", len(paths))
    for i, path in enumerate(paths):
        try:
            with Image.open(path) as img:
                arr = np.asarray(img.convert("RGB"))
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            raise DataError(f"{path} is not a readable image (corrupt or truncated?): {exc}") from exc
        if arr.shape != (SIDE, SIDE, 3):
            raise DataError(f"{path}: expected a {SIDE}x{SIDE} image, got {arr.shape[1]}x{arr.shape[0]}")
        out[i] = arr.transpose(2, 0, 1)
    return out


def _fingerprint(root: Path, paths: list[Path], labels: np.ndarray) -> str:
    digest = hashlib.sha256()
    for path, label in zip(paths, labels):
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise DataError(f"{path} is missing or unreadable: {exc}") from exc
        digest.update(f"{path.relative_to(root)}\t{size}\t{label}\n".encode())
    return digest.hexdigest()[:16]


def _write_cache(path: Path, images: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".part", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                np.save(fh, images)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        for stale in path.parent.glob(f"{path.name.rsplit('-', 1)[0]}-*.npy"):
            if stale != path:
                stale.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot write the Tiny-ImageNet cache %s (%s); images will be decoded again next time", path, exc)


def _read_cache(path: Path, n: int) -> np.ndarray | None:
    if not path.is_file():
        return None
    try:
        images = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        log.warning("ignoring the unreadable cache %s: %s", path, exc)
        return None
    if images.dtype != np.uint8 or images.shape != (n, 3, SIDE, SIDE):
        log.warning(
            "ignoring the cache %s: %s %s instead of uint8 %s", path, images.dtype, images.shape, (n, 3, SIDE, SIDE)
        )
        return None
    return images


def load_tiny_imagenet(
    data_dir: str | Path, *, include_val: bool = False, cache_dir: str | Path | None = None
) -> Dataset:
    """Load Tiny-ImageNet-200 as one normalised pool (train only by default, as FedALA).

    ``data_dir`` holds (or is) the ``tiny-imagenet-200`` folder; ``cache_dir``
    overrides where the decoded ``.npy`` cache goes (default: beside the data).
    """
    root = _root(Path(data_dir))
    paths, labels, wnids = _listing(root, include_val)
    split = "trainval" if include_val else "train"
    cache_folder = Path(cache_dir) if cache_dir is not None else root / ".pflkit-cache"
    cache = cache_folder / f"tiny_imagenet-{split}-{_fingerprint(root, paths, labels)}.npy"
    images = _read_cache(cache, len(paths))
    if images is None:
        images = _decode(paths)
        _write_cache(cache, images)
    x = torch.from_numpy(images).to(torch.float32)
    x.div_(255.0).sub_(0.5).div_(0.5)
    official = sum(p.relative_to(root).parts[0] == "train" for p in paths) if include_val else None
    return Dataset("tiny_imagenet", x, torch.from_numpy(labels), len(wnids), official_train=official)

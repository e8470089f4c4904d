"""CIFAR-10 / CIFAR-100 from the official "python version" pickles, extracted or still in the .tar.gz.

FedALA merges the official train and test sets into one pool (as PFLlib's
``dataset/generate_cifar10.py`` does): the five training batches (CIFAR-10) or ``train``
(CIFAR-100) come first, then the test batch. Images are normalised as ``(x / 255 - 0.5) / 0.5``.
"""

from __future__ import annotations

import io
import pickle
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.data.dataset import Dataset
from pflkit.data.errors import DataError

__all__ = ["CIFAR", "load_cifar"]


@dataclass(frozen=True)
class _Layout:
    folder: str  # top folder inside the archive
    archive: str
    splits: tuple[str, ...]  # training member(s), then the test member
    label_key: bytes
    meta: str
    names_key: bytes
    num_classes: int


CIFAR = {
    "cifar10": _Layout(
        "cifar-10-batches-py",
        "cifar-10-python.tar.gz",
        tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",),
        b"labels",
        "batches.meta",
        b"label_names",
        10,
    ),
    "cifar100": _Layout(
        "cifar-100-python",
        "cifar-100-python.tar.gz",
        ("train", "test"),
        b"fine_labels",
        "meta",
        b"fine_label_names",
        100,
    ),
}

# The pickles hold only numpy arrays, lists, ints and bytes: refuse anything else, so that a
# tampered file cannot run code while being read.
_ALLOWED = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR pickle")
        return super().find_class(module, name)


def _unpickle(raw: bytes, where: str) -> dict[bytes, Any]:
    try:
        obj = _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise DataError(f"{where} is not a readable CIFAR pickle (corrupt or truncated?): {exc}") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a pickled dict, got {type(obj).__name__}")
    return obj


class _Source:
    """Reads members either from the extracted folder or from the .tar.gz archive."""

    def __init__(self, name: str, data_dir: Path) -> None:
        layout = CIFAR[name]
        self.folder: Path | None = None
        self.archive: Path | None = None
        if data_dir.is_file() and data_dir.name.endswith(".tar.gz"):
            self.archive = data_dir
        elif (data_dir / layout.folder).is_dir():
            self.folder = data_dir / layout.folder
        elif data_dir.is_dir() and (data_dir / layout.splits[-1]).is_file():
            self.folder = data_dir  # data_dir is the extracted folder itself
        elif (data_dir / layout.archive).is_file():
            self.archive = data_dir / layout.archive
        else:
            raise DataError(
                f"{name}: {data_dir} holds neither {layout.folder}/ nor {layout.archive}; "
                f"fetch it with: pflkit download {name} {data_dir}"
            )
        self.layout = layout
        self._tar: tarfile.TarFile | None = None

    def __enter__(self) -> _Source:
        if self.archive is not None:
            try:
                self._tar = tarfile.open(self.archive, "r:gz")
            except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
                raise DataError(f"{self.archive} is not a readable .tar.gz archive: {exc}") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tar is not None:
            self._tar.close()

    def read(self, member: str, required: bool = True) -> tuple[bytes | None, str]:
        """The bytes of ``member`` (None if absent and not required) and a name for messages."""
        if self.folder is not None:
            path = self.folder / member
            if not path.is_file():
                if required:
                    raise DataError(
                        f"{path} is missing (expected the {self.layout.folder} files {', '.join(self.layout.splits)})"
                    )
                return None, str(path)
            return path.read_bytes(), str(path)
        assert self._tar is not None
        where = f"{self.archive}:{self.layout.folder}/{member}"
        try:
            info = self._tar.getmember(f"{self.layout.folder}/{member}")
            fh = self._tar.extractfile(info)
            if fh is None:
                raise KeyError(member)
            return fh.read(), where
        except KeyError:
            if required:
                raise DataError(f"{self.archive} has no member {self.layout.folder}/{member}") from None
            return None, where
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            raise DataError(f"{where} cannot be read (corrupt or truncated archive?): {exc}") from exc


def _read_split(source: _Source, member: str) -> tuple[np.ndarray, np.ndarray]:
    raw, where = source.read(member)
    assert raw is not None  # a required member: read raises when it is absent
    batch = _unpickle(raw, where)
    layout = source.layout
    if b"data" not in batch or layout.label_key not in batch:
        raise DataError(f"{where}: expected keys b'data' and {layout.label_key!r}, got {sorted(batch)}")
    data = batch[b"data"]
    try:
        labels = np.asarray(batch[layout.label_key], dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: {layout.label_key!r} is not a list of integers") from exc
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise DataError(
            f"{where}: b'data' must be uint8 [n, 3072] (3x32x32 images), got "
            f"{getattr(data, 'dtype', type(data).__name__)} {shape}"
        )
    if labels.ndim != 1 or len(labels) != len(data):
        raise DataError(f"{where}: {len(data)} images but labels of shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= layout.num_classes):
        raise DataError(f"{where}: labels must be in 0..{layout.num_classes - 1}, found {labels.min()}..{labels.max()}")
    return data, labels


def load_cifar(name: str, data_dir: str | Path) -> Dataset:
    """Load ``"cifar10"`` or ``"cifar100"`` from ``data_dir`` as one normalised pool.

    ``data_dir`` may contain the extracted folder, be that folder, contain the
    original ``.tar.gz`` or be that archive (read in memory, never extracted).
    """
    if name not in CIFAR:
        raise ValueError(f"unknown CIFAR variant {name!r}; available: {', '.join(CIFAR)}")
    with _Source(name, Path(data_dir)) as source:
        meta, where = source.read(source.layout.meta, required=False)
        if meta is not None:
            names = _unpickle(meta, where).get(source.layout.names_key)
            if not isinstance(names, list) or len(names) != source.layout.num_classes:
                raise DataError(
                    f"{where}: expected {source.layout.num_classes} names under "
                    f"{source.layout.names_key!r} (is this {name}?)"
                )
        parts = [_read_split(source, member) for member in source.layout.splits]
    n = sum(len(y) for _, y in parts)
    x = torch.empty((n, 3072), dtype=torch.float32)
    offset = 0
    for data, labels in parts:  # fill in place: no float64 temporaries of the whole pool
        x[offset : offset + len(labels)] = torch.from_numpy(data)
        offset += len(labels)
    x.div_(255.0).sub_(0.5).div_(0.5)
    y = torch.from_numpy(np.concatenate([labels for _, labels in parts]))
    test = len(parts[-1][1])  # the last member is the test batch
    return Dataset(name, x.view(n, 3, 32, 32), y, source.layout.num_classes, official_train=n - test)

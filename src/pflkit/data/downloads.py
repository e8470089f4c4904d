"""Download the official dataset files into a folder the loaders read (atomic, verified).

Archives are checked against their official md5 sums; the AG News CSVs have no
published checksum, so they are checked by parsing them (and by row count).
Files already present are checked the same way, not fetched again.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from pflkit.data.cifar import CIFAR
from pflkit.data.errors import DataError
from pflkit.data.fetch import check_present, fetch, md5_check
from pflkit.data.sources import download_mnist

__all__ = [
    "DOWNLOADS",
    "download",
    "download_agnews",
    "download_cifar10",
    "download_cifar100",
    "download_tiny_imagenet",
]

_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/"
_CIFAR_MD5 = {"cifar10": "c58f30108f718f92721af3b95e74349a", "cifar100": "eb9058c3a382ffc7106e4002c42a8d85"}
_TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
_TINY_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"
_AGNEWS_URL = "https://raw.githubusercontent.com/mhjabreel/CharCnn_Keras/master/data/ag_news_csv/"
_AGNEWS_ROWS = {"train.csv": 120_000, "test.csv": 7_600}


def _download_cifar(name: str, data_dir: str | Path) -> Path:
    data_dir = Path(data_dir)
    layout = CIFAR[name]
    archive = data_dir / layout.archive
    if archive.is_file():
        check_present(archive, md5_check(_CIFAR_MD5[name]))
    elif not (data_dir / layout.folder).is_dir():
        fetch([_CIFAR_URL + layout.archive], archive, md5_check(_CIFAR_MD5[name]))
    return data_dir


def download_cifar10(data_dir: str | Path) -> Path:
    """Fetch ``cifar-10-python.tar.gz`` into ``data_dir`` (read as is, never extracted); return ``data_dir``."""
    return _download_cifar("cifar10", data_dir)


def download_cifar100(data_dir: str | Path) -> Path:
    """Fetch ``cifar-100-python.tar.gz`` into ``data_dir`` (read as is, never extracted); return ``data_dir``."""
    return _download_cifar("cifar100", data_dir)


def download_tiny_imagenet(data_dir: str | Path) -> Path:
    """Fetch and extract ``tiny-imagenet-200.zip`` into ``data_dir``; return ``data_dir``.

    The archive is extracted into a temporary folder that is renamed into place
    only when complete; the zip is deleted afterwards.
    """
    data_dir = Path(data_dir)
    target = data_dir / "tiny-imagenet-200"
    if (target / "wnids.txt").is_file():
        return data_dir
    archive = data_dir / "tiny-imagenet-200.zip"
    if archive.is_file():
        check_present(archive, md5_check(_TINY_MD5))
    else:
        fetch([_TINY_URL], archive, md5_check(_TINY_MD5), timeout=120)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-imagenet-200.", dir=data_dir))
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        if not (tmp / "tiny-imagenet-200" / "wnids.txt").is_file():
            raise DataError(f"{archive} does not contain tiny-imagenet-200/wnids.txt")
        if target.exists():  # an incomplete earlier tree without wnids.txt
            shutil.rmtree(target)
        (tmp / "tiny-imagenet-200").rename(target)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DataError(f"cannot extract {archive}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    archive.unlink()
    return data_dir


def _agnews_check(filename: str) -> Callable[[Path], None]:
    from pflkit.data.agnews import read_agnews_csv

    def verify(path: Path) -> None:
        _, labels = read_agnews_csv(path)
        if len(labels) != _AGNEWS_ROWS[filename]:
            raise DataError(f"{filename}: expected {_AGNEWS_ROWS[filename]} rows, got {len(labels)}")

    return verify


def download_agnews(data_dir: str | Path) -> Path:
    """Fetch the AG News ``train.csv`` and ``test.csv`` into ``data_dir``; return ``data_dir``."""
    data_dir = Path(data_dir)
    for filename in _AGNEWS_ROWS:
        if (data_dir / filename).is_file():
            check_present(data_dir / filename, _agnews_check(filename))
        else:
            fetch([_AGNEWS_URL + filename], data_dir / filename, _agnews_check(filename))
    return data_dir


DOWNLOADS: dict[str, Callable[[str | Path], Path]] = {
    "mnist": download_mnist,
    "cifar10": download_cifar10,
    "cifar100": download_cifar100,
    "tiny_imagenet": download_tiny_imagenet,
    "agnews": download_agnews,
}


def download(name: str, data_dir: str | Path) -> Path:
    """Download dataset ``name`` (see :data:`DOWNLOADS`) into ``data_dir`` and return ``data_dir``.

    Files already there are kept; pass the same ``data_dir`` to :func:`pflkit.data.load_dataset`.
    """
    if name not in DOWNLOADS:
        raise ValueError(
            f"no download for dataset {name!r}; downloadable: {', '.join(DOWNLOADS)} "
            "(digits and synthetic are built in; pfllib folders come from PFLlib)"
        )
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    return DOWNLOADS[name](data_dir)

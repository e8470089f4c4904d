"""Download the official dataset files into a folder the loaders read (atomic, verified).

Archives are checked against their official md5 sums; the AG News CSVs have no
published checksum, so they are checked by parsing them (and by row count).
Files already present are checked the same way, not fetched again.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
import zipfile
import zlib
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
    "download_cinic10",
    "download_domainnet",
    "download_emnist",
    "download_fashion_mnist",
    "download_svhn",
    "download_tiny_imagenet",
    "download_usps",
]

_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/"
_CIFAR_MD5 = {"cifar10": "c58f30108f718f92721af3b95e74349a", "cifar100": "eb9058c3a382ffc7106e4002c42a8d85"}
_TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
_TINY_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"
_AGNEWS_URL = "https://raw.githubusercontent.com/mhjabreel/CharCnn_Keras/master/data/ag_news_csv/"
_AGNEWS_ROWS = {"train.csv": 120_000, "test.csv": 7_600}
_FASHION_URLS = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
)
_FASHION_MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
_EMNIST_URL = "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip"
_EMNIST_MD5 = "58c8d27c78d21e728a6bc7b3cc06412e"
_SVHN_URL = "http://ufldl.stanford.edu/housenumbers/"
_SVHN_MD5 = {
    "train_32x32.mat": "e26dedcc434d2e4c54c9b2d4a06d8373",
    "test_32x32.mat": "eb5a983be6a315427106f1b164d9cef3",
}
_USPS_URL = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/"
_USPS_MD5 = {"usps.bz2": "ec16c51db3855ca6c91edd34d0e9b197", "usps.t.bz2": "8ea070ee2aca1ac39742fdd1ef5ed118"}
# no checksum is published for CINIC-10: the archive is checked by its layout (train/, valid/, test/)
_CINIC_URL = "https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz"
# DomainNet's cleaned version (ai.bu.edu/M3SDA): clipart and painting are served from groundtruth/;
# no checksums are published, so each zip is checked by its layout and each split file by parsing it
_DOMAINNET_URL = "http://csr.bu.edu/ftp/visda/2019/multi-source/"
_DOMAINNET_ZIPS = {
    "clipart": "groundtruth/clipart.zip",
    "infograph": "infograph.zip",
    "painting": "groundtruth/painting.zip",
    "quickdraw": "quickdraw.zip",
    "real": "real.zip",
    "sketch": "sketch.zip",
}


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


def _fetch_md5(data_dir: Path, bases: tuple[str, ...], sums: dict[str, str]) -> Path:
    """Each file of ``sums`` into ``data_dir``: one already there is checked, a missing one fetched."""
    for filename, md5 in sums.items():
        if (data_dir / filename).is_file():
            check_present(data_dir / filename, md5_check(md5))
        else:
            fetch([base + filename for base in bases], data_dir / filename, md5_check(md5), timeout=120)
    return data_dir


def download_fashion_mnist(data_dir: str | Path) -> Path:
    """Fetch Fashion-MNIST's four ``.gz`` IDX files into ``data_dir`` (official md5 sums); return ``data_dir``."""
    return _fetch_md5(Path(data_dir), _FASHION_URLS, _FASHION_MD5)


def download_svhn(data_dir: str | Path) -> Path:
    """Fetch SVHN's ``train_32x32.mat`` and ``test_32x32.mat`` into ``data_dir``; return ``data_dir``."""
    return _fetch_md5(Path(data_dir), (_SVHN_URL,), _SVHN_MD5)


def download_usps(data_dir: str | Path) -> Path:
    """Fetch USPS's ``usps.bz2`` and ``usps.t.bz2`` (libsvm) into ``data_dir``; return ``data_dir``."""
    return _fetch_md5(Path(data_dir), (_USPS_URL,), _USPS_MD5)


def _extract(archive: Path, target: Path, opener: Callable[[Path, Path], Path]) -> None:
    """``opener(archive, tmp)`` extracts into a temporary folder and returns the folder to keep,
    which is renamed to ``target`` only when complete; the archive is deleted afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        kept = opener(archive, tmp)
        if target.exists():  # an incomplete earlier extraction
            shutil.rmtree(target)
        kept.rename(target)
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as exc:
        raise DataError(f"cannot extract {archive}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    archive.unlink()


def _emnist_zip(archive: Path, tmp: Path) -> Path:
    with zipfile.ZipFile(archive) as zf:
        members = [m for m in zf.namelist() if m.startswith("gzip/emnist-") and m.endswith(".gz")]
        if not members:
            raise DataError(f"{archive} holds no gzip/emnist-*.gz files")
        zf.extractall(tmp, members)
    return tmp / "gzip"


def download_emnist(data_dir: str | Path) -> Path:
    """Fetch NIST's EMNIST ``gzip.zip`` (official md5) and extract its IDX files into ``data_dir/gzip``."""
    data_dir = Path(data_dir)
    if any((data_dir / "gzip").glob("emnist-*-ubyte.gz")):
        return data_dir
    archive = data_dir / "gzip.zip"
    if archive.is_file():
        check_present(archive, md5_check(_EMNIST_MD5))
    else:
        fetch([_EMNIST_URL], archive, md5_check(_EMNIST_MD5), timeout=120)
    _extract(archive, data_dir / "gzip", _emnist_zip)
    return data_dir


def _cinic_check(path: Path) -> None:
    try:
        with tarfile.open(path, "r:gz") as tar:
            names = {n.removeprefix("./").split("/")[0] for n in tar.getnames()}
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise DataError(f"{path.name} is not a readable .tar.gz archive: {exc}") from None
    if not {"train", "valid", "test"} <= names:
        raise DataError(f"{path.name} lacks train/, valid/ and test/ at its top (found {', '.join(sorted(names))})")


def _cinic_tar(archive: Path, tmp: Path) -> Path:
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(tmp, filter="data")
    return tmp


def download_cinic10(data_dir: str | Path) -> Path:
    """Fetch ``CINIC-10.tar.gz`` and extract it into ``data_dir/CINIC-10``; return ``data_dir``."""
    data_dir = Path(data_dir)
    target = data_dir / "CINIC-10"
    if all((target / split).is_dir() for split in ("train", "valid", "test")):
        return data_dir
    archive = data_dir / "CINIC-10.tar.gz"
    if archive.is_file():
        check_present(archive, _cinic_check)
    else:
        fetch([_CINIC_URL], archive, _cinic_check, timeout=120)
    _extract(archive, target, _cinic_tar)
    return data_dir


def _domainnet_zip_check(domain: str) -> Callable[[Path], None]:
    def verify(path: Path) -> None:
        try:
            with zipfile.ZipFile(path) as zf:
                tops = {n.split("/")[0] for n in zf.namelist()}
        except (zipfile.BadZipFile, OSError) as exc:
            raise DataError(f"{path.name} is not a readable zip archive: {exc}") from None
        if tops != {domain}:
            raise DataError(
                f"{path.name} should hold one folder {domain}/ at its top (found {', '.join(sorted(tops))})"
            )

    return verify


def _domainnet_split_check(path: Path) -> None:
    """A split file: non-empty, one '<domain>/<class>/<image> <label>' per line."""
    lines = [line.split() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    bad = next((i for i, f in enumerate(lines, 1) if len(f) != 2 or not f[1].isdigit()), None)
    if not lines or bad is not None:
        raise DataError(f"{path.name} is not a DomainNet split file ('path label' lines; line {bad or 1})")


def download_domainnet(data_dir: str | Path, domains: tuple[str, ...] = tuple(_DOMAINNET_ZIPS)) -> Path:
    """Fetch DomainNet's ``domains`` (all six: about 18 GB of zips) into ``data_dir``, each extracted
    into ``data_dir/<domain>`` with its official ``<domain>_train.txt`` and ``<domain>_test.txt``
    beside it: the layout the ``domainnet`` dataset reads; return ``data_dir``."""
    data_dir = Path(data_dir)
    for domain in domains:
        if not (data_dir / domain).is_dir():
            archive = data_dir / f"{domain}.zip"
            if archive.is_file():
                check_present(archive, _domainnet_zip_check(domain))
            else:
                fetch([_DOMAINNET_URL + _DOMAINNET_ZIPS[domain]], archive, _domainnet_zip_check(domain), timeout=120)

            def unzip(archive: Path, tmp: Path, domain: str = domain) -> Path:
                with zipfile.ZipFile(archive) as zf:
                    zf.extractall(tmp)
                return tmp / domain

            _extract(archive, data_dir / domain, unzip)
        for part in ("train", "test"):
            split = data_dir / f"{domain}_{part}.txt"
            if split.is_file():
                check_present(split, _domainnet_split_check)
            else:
                fetch([f"{_DOMAINNET_URL}domainnet/txt/{split.name}"], split, _domainnet_split_check)
    return data_dir


DOWNLOADS: dict[str, Callable[[str | Path], Path]] = {
    "mnist": download_mnist,
    "cifar10": download_cifar10,
    "cifar100": download_cifar100,
    "tiny_imagenet": download_tiny_imagenet,
    "agnews": download_agnews,
    "fashion_mnist": download_fashion_mnist,
    "emnist": download_emnist,
    "svhn": download_svhn,
    "usps": download_usps,
    "cinic10": download_cinic10,
    "domainnet": download_domainnet,
}


def download(name: str, data_dir: str | Path) -> Path:
    """Download dataset ``name`` (see :data:`DOWNLOADS`) into ``data_dir`` and return ``data_dir``.

    Files already there are kept; pass the same ``data_dir`` to :func:`pflkit.data.load_dataset`.
    """
    if name not in DOWNLOADS:
        raise ValueError(
            f"no download for dataset {name!r}; downloadable: {', '.join(DOWNLOADS)} "
            "(digits, synthetic and fedprox_synthetic are built in; pfllib folders come from PFLlib, "
            "femnist, shakespeare, sent140 and leaf folders from LEAF's or pFedMe's scripts; digit5 and "
            "office_caltech10 from FedBN's archives, by hand)"
        )
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    return DOWNLOADS[name](data_dir)

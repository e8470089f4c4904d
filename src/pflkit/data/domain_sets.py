"""Multi-domain image datasets read domain by domain: Digit-5 (FedBN's pickles), Office-Caltech-10
and DomainNet (folder trees of images). :mod:`pflkit.data.domain_clients` makes their clients.

* ``digit5``: FedBN's ``digit_dataset.zip`` (med-air/FedBN), folders ``MNIST/``, ``SVHN/``, ``USPS/``,
  ``SynthDigits/``, ``MNIST_M/``, each with ``partitions/train_part{k}.pkl`` (k = 0..9, 743 images
  each) and ``test.pkl``: pickled ``(images, labels)`` pairs of uint8 arrays ``[n, H, W]`` (grey) or
  ``[n, H, W, 3]`` (RGB) and integer labels 0..9. ``percent`` reads FedBN's ``DigitsDataset``
  way: ``int(percent * 10)`` whole parts from 0.1 on, else the first ``percent * 10`` of part 0.
  Images are resized to 28x28 (PIL bilinear, as torchvision's ``Resize``), grey ones repeated to
  RGB, and normalised as ``(x / 255 - 0.5) / 0.5``: FedBN's transforms.
* ``office_caltech10``: ``<domain>/<class>/*.jpg`` (in ``data_dir`` or ``data_dir/office_caltech_10``)
  for amazon, caltech, dslr and webcam. With FedBN's split files ``<domain>_train.pkl`` and
  ``<domain>_test.pkl`` next to the domain folders (pickled ``(paths, class names)``), their split is
  read; otherwise a fixed stratified 75/25 split (seed 0) of each domain.
* ``domainnet``: ``<domain>/<class>/*.jpg`` with the official ``<domain>_train.txt`` and
  ``<domain>_test.txt`` (``path label`` per line, paths relative to ``data_dir``).

Office and DomainNet images are read as RGB, resized to ``image_size`` square (PIL bilinear) and
normalised as the digits; ``classes`` picks a subset of the class folders, labelled in its order.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.data.errors import DataError
from pflkit.data.partition.holdout import stratified_test_split
from pflkit.data.sources import data_folder

__all__ = [
    "DIGIT5_FOLDERS",
    "DOMAIN_DATASETS",
    "FEDBN_DOMAINNET_CLASSES",
    "DomainOptions",
    "DomainSplit",
    "read_domains",
]

#: every multi-domain dataset and its domains, in their default client order (FedBN's)
DOMAIN_DATASETS: dict[str, tuple[str, ...]] = {
    "digit5": ("mnist", "svhn", "usps", "synth", "mnistm"),
    "office_caltech10": ("amazon", "caltech", "dslr", "webcam"),
    "domainnet": ("clipart", "infograph", "painting", "quickdraw", "real", "sketch"),
}
#: Digit-5 domain -> folder of FedBN's archive
DIGIT5_FOLDERS = {"mnist": "MNIST", "svhn": "SVHN", "usps": "USPS", "synth": "SynthDigits", "mnistm": "MNIST_M"}
#: the ten DomainNet classes of FedBN's experiments
FEDBN_DOMAINNET_CLASSES = (
    "bird",
    "feather",
    "headphones",
    "ice_cream",
    "teapot",
    "tiger",
    "whale",
    "windmill",
    "wine_glass",
    "zebra",
)
DIGIT_SIDE = 28


@dataclass(frozen=True)
class DomainOptions:
    """What to read of a multi-domain dataset and how its domains become clients."""

    domains: tuple[str, ...] | None = None  # None: all of the dataset's, in its order
    percent: float = 0.1  # digit5: share of the training data (FedBN's parts)
    classes: tuple[str, ...] | None = None  # office_caltech10, domainnet: a subset of the classes
    image_size: int = 64  # office_caltech10, domainnet: side of the resized images
    clients_per_domain: int = 1
    heldout_domains: tuple[str, ...] = ()

    def chosen(self, dataset: str) -> tuple[str, ...]:
        """The domains read, checked against the dataset's (ValueError naming the unknown one)."""
        known = DOMAIN_DATASETS[dataset]
        picked = known if self.domains is None else self.domains
        if not picked:
            raise ValueError(f"no domains chosen: pick some of {', '.join(known)} (or all: leave domains unset)")
        for name in (*picked, *self.heldout_domains):
            if name not in known:
                raise ValueError(f"{dataset} has no domain {name!r}; its domains: {', '.join(known)}")
        return tuple(picked)


@dataclass(frozen=True)
class DomainSplit:
    """One domain's images (float32 [n, 3, H, W], normalised) and labels, train and test."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


class _ArraysOnly(pickle.Unpickler):
    """Unpickles tuples, lists, strings and numpy arrays only (a pickle may not run other code)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing {module}.{name} (only numpy arrays are read)")
        return super().find_class(module, name)


def _pair(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The pickled (first, second) pair of ``path`` as arrays of one length."""
    if not path.is_file():
        raise DataError(f"{path} is missing")
    try:
        with path.open("rb") as f:
            obj = _ArraysOnly(f).load()
    except Exception as exc:  # any unpickling failure: truncated, foreign objects, not a pickle
        raise DataError(f"{path} is not a readable pickle of arrays: {exc}") from None
    if not isinstance(obj, (tuple, list)) or len(obj) != 2:
        raise DataError(f"{path}: expected a pickled (images, labels) pair, got {type(obj).__name__}")
    first, second = np.asarray(obj[0]), np.asarray(obj[1])
    if second.ndim == 2 and second.shape[1] == 1:  # labels [n, 1], as FedBN's squeeze() accepts
        second = second[:, 0]
    if second.ndim != 1 or len(first) != len(second):
        raise DataError(f"{path}: {len(first)} samples but labels of shape {second.shape}")
    return first, second


def _normalised(images: np.ndarray) -> torch.Tensor:
    """uint8 [n, H, W, 3] -> float32 [n, 3, H, W] in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))).float()
    return x.div_(255.0).sub_(0.5).div_(0.5)


def _digits(path: Path) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    images, labels = _pair(path)
    grey = images.ndim == 3
    if images.dtype != np.uint8 or not (grey or (images.ndim == 4 and images.shape[-1] == 3)):
        raise DataError(
            f"{path}: expected uint8 images [n, H, W] or [n, H, W, 3], got {images.dtype} {list(images.shape)}"
        )
    if labels.size and (not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{path}: expected digit labels 0..9, got {labels.dtype} values")
    if images.shape[1:3] != (DIGIT_SIDE, DIGIT_SIDE):
        size = (DIGIT_SIDE, DIGIT_SIDE)
        images = np.stack([np.asarray(Image.fromarray(im).resize(size, Image.Resampling.BILINEAR)) for im in images])
    if grey:
        images = np.repeat(images[..., None], 3, axis=-1)
    return images, labels.astype(np.int64)


def _digit_domain(root: Path, domain: str, percent: float) -> DomainSplit:
    folder = root / DIGIT5_FOLDERS[domain]
    if not folder.is_dir():
        raise DataError(
            f"digit5: {folder} is missing (domain {domain!r}); FedBN's digit_dataset.zip holds "
            f"{', '.join(DIGIT5_FOLDERS.values())}"
        )
    parts = int(percent * 10 + 1e-9)
    if parts >= 1:
        pairs = [_digits(folder / "partitions" / f"train_part{k}.pkl") for k in range(parts)]
        train = np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
    else:  # FedBN: the first percent * 10 of part 0
        images, labels = _digits(folder / "partitions" / "train_part0.pkl")
        n = int(len(labels) * percent * 10)
        train = images[:n], labels[:n]
    test = _digits(folder / "test.pkl")
    return DomainSplit(
        domain, _normalised(train[0]), torch.from_numpy(train[1]), _normalised(test[0]), torch.from_numpy(test[1])
    )


def _image(path: Path, side: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("RGB").resize((side, side), Image.Resampling.BILINEAR))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{path} is not a readable image (corrupt or truncated?): {exc}") from None


def _images(paths: Sequence[Path], side: int) -> np.ndarray:
    if not paths:
        return np.zeros((0, side, side, 3), dtype=np.uint8)
    return np.stack([_image(p, side) for p in paths])


_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def _class_folders(folder: Path, classes: tuple[str, ...] | None) -> tuple[str, ...]:
    if not folder.is_dir():
        raise DataError(f"{folder} is missing (a folder of <class>/ image folders per domain)")
    found = sorted(p.name for p in folder.iterdir() if p.is_dir())
    for name in classes or ():
        if name not in found:
            raise DataError(f"{folder} has no class folder {name!r} (data.classes); it has {', '.join(found[:12])}")
    if not found:
        raise DataError(f"{folder} holds no class folders")
    return classes or tuple(found)


def _tree_domain(
    folder: Path, classes: tuple[str, ...], side: int, splits: Path | None, skipped: tuple[str, ...] = ()
) -> DomainSplit:
    """A domain folder of class folders; ``splits``: the folder with FedBN's <domain>_train/_test.pkl,
    ``skipped``: the class folders left out of ``classes``."""
    label = {c: i for i, c in enumerate(classes)}
    if splits is not None:
        rows = []
        for part in ("train", "test"):
            path = splits / f"{folder.name}_{part}.pkl"
            names, texts = _pair(path)
            unknown = sorted({str(t) for t in texts} - set(label) - set(skipped))
            if unknown:
                raise DataError(f"{path} labels images {unknown[0]!r}, which has no class folder in {folder}")
            kept = [(str(n), label[str(t)]) for n, t in zip(names, texts) if str(t) in label]
            images = []
            for name, _ in kept:
                image = next((b / name for b in (splits, splits.parent) if _inside(b / name, b)), None)
                if image is None:
                    raise DataError(f"{path} names {name}, which is not under {splits} nor {splits.parent}")
                images.append(image)
            rows.append((_images(images, side), np.asarray([y for _, y in kept], dtype=np.int64)))
        (trx, try_), (tex, tey) = rows
    else:
        paths, ys = [], []
        for c in classes:
            found = sorted(p for p in (folder / c).iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
            paths += found
            ys += [label[c]] * len(found)
        if len(paths) < 2 * len(classes):
            raise DataError(f"{folder}: {len(paths)} images, fewer than two per class (a train/test split needs them)")
        y = np.asarray(ys, dtype=np.int64)
        train_rows, test_rows = stratified_test_split(y)
        x = _images(paths, side)
        trx, try_, tex, tey = x[train_rows], y[train_rows], x[test_rows], y[test_rows]
    return DomainSplit(folder.name, _normalised(trx), torch.from_numpy(try_), _normalised(tex), torch.from_numpy(tey))


def _office_base(root: Path, domains: tuple[str, ...]) -> Path:
    return next((b for b in (root, root / "office_caltech_10") if (b / domains[0]).is_dir()), root)


def _office(root: Path, domains: tuple[str, ...], classes: tuple[str, ...] | None, side: int) -> list[DomainSplit]:
    base = _office_base(root, domains)
    found = _class_folders(base / domains[0], None)
    names = classes or found
    for d in domains:
        _class_folders(base / d, names)
    fedbn = all((base / f"{d}_{p}.pkl").is_file() for d in domains for p in ("train", "test"))
    skipped = tuple(c for c in found if c not in names)
    return [_tree_domain(base / d, names, side, base if fedbn else None, skipped) for d in domains]


def _split_file(root: Path, domain: str, part: str, classes: tuple[str, ...] | None) -> tuple[list[Path], list[int]]:
    path = root / f"{domain}_{part}.txt"
    if not path.is_file():
        raise DataError(f"domainnet: {path} is missing (DomainNet's split file: one 'path label' per line)")
    label = None if classes is None else {c: i for i, c in enumerate(classes)}
    paths, ys = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or not fields[1].isdigit():
            raise DataError(f"{path}:{number}: expected 'path label', got {line.strip()[:80]!r}")
        name = Path(fields[0]).parent.name
        if label is not None and name not in label:
            continue
        image = root / fields[0]
        if not _inside(image, root):
            raise DataError(f"{path}:{number}: names {fields[0]}, which is not under {root}")
        paths.append(image)
        ys.append(int(fields[1]) if label is None else label[name])
    return paths, ys


def _domainnet(root: Path, domains: tuple[str, ...], classes: tuple[str, ...] | None, side: int) -> list[DomainSplit]:
    out = []
    for d in domains:
        if not (root / d).is_dir():
            raise DataError(
                f"domainnet: {root / d} is missing (domain {d!r}: a folder of <class>/ image folders); "
                f"fetch: pflkit download domainnet {root}"
            )
        if classes is not None:
            _class_folders(root / d, classes)
        (trp, trl), (tep, tel) = (_split_file(root, d, part, classes) for part in ("train", "test"))
        x_tr, x_te = _normalised(_images(trp, side)), _normalised(_images(tep, side))
        y_tr, y_te = torch.tensor(trl, dtype=torch.int64), torch.tensor(tel, dtype=torch.int64)
        out.append(DomainSplit(d, x_tr, y_tr, x_te, y_te))
    return out


def read_domains(dataset: str, data_dir: str | Path, options: DomainOptions) -> tuple[list[DomainSplit], int]:
    """The chosen domains of ``dataset`` (see :data:`DOMAIN_DATASETS`) and the class count."""
    if dataset not in DOMAIN_DATASETS:
        raise ValueError(f"{dataset!r} is no multi-domain dataset; those: {', '.join(DOMAIN_DATASETS)}")
    domains = options.chosen(dataset)
    root = data_folder(data_dir)
    if not root.is_dir():
        raise DataError(f"{dataset}: data_dir {root} is not a folder")
    if dataset == "digit5":
        if not 0 < options.percent <= 1:
            raise ValueError(f"percent must be in (0, 1], got {options.percent}")
        return [_digit_domain(root, d, options.percent) for d in domains], 10
    if dataset == "office_caltech10":
        splits = _office(root, domains, options.classes, options.image_size)
        return splits, len(options.classes or _class_folders(_office_base(root, domains) / domains[0], None))
    splits = _domainnet(root, domains, options.classes, options.image_size)
    if options.classes is not None:
        return splits, len(options.classes)
    top = max((int(t.max()) for s in splits for t in (s.train_y, s.test_y) if len(t)), default=-1)
    return splits, top + 1


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is a file under ``folder`` (a split file's name never reaches outside it)."""
    return path.is_file() and path.resolve().is_relative_to(folder.resolve())

"""LEAF's JSON format, read with its natural clients (one client per user).

A LEAF dataset folder holds ``train/`` and ``test/`` (or ``data/train/`` and ``data/test/``), each
with one or more ``.json`` files of the form ``{"users": [...], "num_samples": [...],
"user_data": {user: {"x": [...], "y": [...]}}}``; a user's samples may be spread over the files of
one split only once. Every user needs samples in both splits (LEAF's sample split, ``--t sample``).

What each dataset name reads:

* ``femnist``: x = 784 pixel values in [0, 1] (28x28, LEAF's white background = 1), y in 0..61;
  images [1, 28, 28] normalised to [-1, 1] as every pflkit image.
* ``shakespeare``: x = strings of one length (80), y = the next character; both mapped to ids in
  LEAF's 80-character vocabulary (:data:`LETTERS`), 80 classes.
* ``sent140``: x = LEAF's ``[id, date, query, user, text]`` rows, y = Sentiment140's 0 (negative)
  or 4 (positive), as strings or numbers; the text is split with LEAF's ``split_line`` and mapped
  to the first 25 word ids (LEAF's ``line_to_indices``) in a vocabulary of the training texts
  (0 = padding, 1 = unknown word; LEAF's GloVe vocabulary is not used). Classes 0/1.
* ``leaf``: numeric sets in the same format (the MNIST and Synthetic sets of pFedMe and
  Per-FedAvg, FedProx's Synthetic): x = equal-length number lists kept as they are, read as
  one-channel images [1, H, H] when their length is a square of at least 16 (784 = 28x28) and as
  feature vectors [D] otherwise; y = integer labels (integral floats accepted), classes 0..max.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.data.errors import DataError
from pflkit.data.federated import ClientData, FederatedData
from pflkit.data.sources import data_folder

__all__ = ["LEAF_DATASETS", "LETTERS", "load_leaf", "read_leaf_split", "split_line"]

#: LEAF's Shakespeare vocabulary (``ALL_LETTERS`` of its language_utils.py)
LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
LEAF_DATASETS = ("femnist", "shakespeare", "sent140", "leaf")
SENT140_WORDS = 25
FEMNIST_CLASSES = 62
_LETTER_ID = {c: i for i, c in enumerate(LETTERS)}

#: one user's samples and the file that holds them
User = tuple[list[Any], list[Any], Path]


def split_line(line: str) -> list[str]:
    """LEAF's Sent140 tokenizer: words (with apostrophes) and the punctuation . , ! ? ;"""
    return re.findall(r"[\w']+|[.,!?;]", line)


def read_leaf_split(folder: Path) -> dict[str, User]:
    """user -> (x, y, file) over every ``.json`` of ``folder`` (file-name order), each file checked:
    ``num_samples`` must match ``users`` and every user's ``x`` and ``y``."""
    files = sorted(folder.glob("*.json"))
    if not files:
        raise DataError(f"{folder} holds no .json files (a LEAF split folder holds one or more)")
    users: dict[str, User] = {}
    for path in files:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path} is not readable LEAF JSON (truncated or corrupt?): {exc}") from None
        if not isinstance(doc, dict) or not all(k in doc for k in ("users", "num_samples", "user_data")):
            raise DataError(f"{path}: expected a JSON object with users, num_samples and user_data (LEAF's format)")
        names, counts, data = doc["users"], doc["num_samples"], doc["user_data"]
        if not isinstance(names, list) or not isinstance(counts, list) or not isinstance(data, dict):
            raise DataError(f"{path}: users and num_samples must be lists and user_data an object")
        if len(names) != len(counts):
            raise DataError(f"{path}: {len(names)} users but {len(counts)} num_samples entries")
        extra = set(data) - set(names)
        if extra:
            raise DataError(f"{path}: user_data holds user {sorted(extra)[0]!r}, which users does not list")
        for name, count in zip(names, counts):
            name = str(name)  # JSON object keys are strings
            entry = data.get(name)
            if not (isinstance(entry, dict) and isinstance(entry.get("x"), list) and isinstance(entry.get("y"), list)):
                raise DataError(f"{path}: user {name!r} has no user_data entry with lists x and y")
            x, y = entry["x"], entry["y"]
            if count != len(x) or count != len(y):
                raise DataError(
                    f"{path}: user {name!r} has num_samples {count} but {len(x)} x and {len(y)} y in user_data"
                )
            if name in users:
                raise DataError(f"{path}: user {name!r} is also in {users[name][2]} (a user may appear once per split)")
            users[str(name)] = (x, y, path)
    return users


def _split_folders(root: Path) -> tuple[Path, Path]:
    for base in (root, root / "data"):
        if (base / "train").is_dir() and (base / "test").is_dir():
            return base / "train", base / "test"
    raise DataError(
        f"{root} is no LEAF dataset folder: it lacks train/ and test/ (of .json files); LEAF publishes no "
        "ready files: generate them with preprocess.sh of github.com/TalwalkarLab/leaf (e.g. in data/femnist: "
        "./preprocess.sh -s niid --sf 0.05 -k 0 -t sample) and give its data/ folder"
    )


def _labels(y: list[Any], where: str) -> np.ndarray:
    try:
        values = np.asarray(y, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: y must be numbers ({exc})") from None
    if values.ndim != 1 or (values.size and (np.any(values != np.round(values)) or values.min() < 0)):
        raise DataError(f"{where}: y must be integer labels >= 0")
    return values.astype(np.int64)


def _numbers(x: list[Any], where: str) -> np.ndarray:
    if not x:
        return np.zeros((0, 0), dtype=np.float32)  # shaped like the others' samples when the clients are built
    try:
        values = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: x must be number lists of one length ({exc})") from None
    if values.ndim != 2:
        raise DataError(f"{where}: x must be number lists of one length, got shape {values.shape}")
    return values


def _femnist(x: list[Any], y: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    values, labels = _numbers(x, where), _labels(y, where)
    if len(values) and values.shape[1] != 784:
        raise DataError(f"{where}: FEMNIST x must hold 784 pixels (28x28) per sample, got {values.shape[1]}")
    if labels.size and labels.max() >= FEMNIST_CLASSES:
        raise DataError(f"{where}: FEMNIST labels must be in 0..61, found {labels.max()}")
    return ((values - 0.5) / 0.5).reshape(-1, 1, 28, 28), labels


def _numeric(x: list[Any], y: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    values = _numbers(x, where)
    side = math.isqrt(values.shape[1])
    if len(values) and side >= 4 and side * side == values.shape[1]:
        values = values.reshape(-1, 1, side, side)
    return values, _labels(y, where)


def _characters(text: Any, where: str, what: str) -> list[int]:
    if not isinstance(text, str):
        raise DataError(f"{where}: {what} must be strings, got {type(text).__name__}")
    try:
        return [_LETTER_ID[c] for c in text]
    except KeyError as exc:
        raise DataError(f"{where}: character {exc.args[0]!r} is not in LEAF's 80-character vocabulary") from None


def _shakespeare(x: list[Any], y: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    ids = [_characters(text, where, "x") for text in x]
    if len({len(row) for row in ids}) > 1:
        raise DataError(f"{where}: x strings must share one length, found {sorted({len(r) for r in ids})[:3]}")
    labels = [_characters(c, where, "y") for c in y]
    if any(len(c) != 1 for c in labels):
        raise DataError(f"{where}: y must be single characters (the next character)")
    return np.asarray(ids, dtype=np.int64).reshape(len(ids), -1 if ids else 0), np.asarray(
        [c[0] for c in labels], dtype=np.int64
    )


def _tweet(row: Any, where: str) -> str:
    if isinstance(row, list) and len(row) >= 5 and isinstance(row[4], str):
        return row[4]
    raise DataError(f"{where}: Sent140 x rows must be [id, date, query, user, text] lists")


def _sentiment(y: list[Any], where: str) -> np.ndarray:
    out = []
    for value in y:
        try:
            number = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
        except ValueError:
            number = None
        label = {0.0: "0", 4.0: "4"}.get(number) if number is not None else None
        if label not in ("0", "4"):
            raise DataError(f"{where}: Sent140 labels must be 0 (negative) or 4 (positive), found {value!r}")
        out.append(1 if label == "4" else 0)
    return np.asarray(out, dtype=np.int64)


def _sent140(
    train: dict[str, User], test: dict[str, User]
) -> tuple[dict[tuple[str, str], tuple[np.ndarray, np.ndarray]], int]:
    counts = Counter(w for x, _, path in train.values() for row in x for w in split_line(_tweet(row, str(path))))
    vocab = {w: i + 2 for i, (w, _) in enumerate(sorted(counts.items(), key=lambda item: (-item[1], item[0])))}
    out = {}
    for split, users in (("train", train), ("test", test)):
        for name, (x, y, path) in users.items():
            where = f"{path}: user {name!r}"
            ids = np.zeros((len(x), SENT140_WORDS), dtype=np.int64)
            for row, sample in zip(ids, x):
                words = [vocab.get(w, 1) for w in split_line(_tweet(sample, where))][:SENT140_WORDS]
                row[: len(words)] = words
            out[(split, name)] = (ids, _sentiment(y, where))
    return out, len(vocab) + 2


def load_leaf(data_dir: str | Path, name: str = "leaf", *, device: torch.device | str = "cpu") -> FederatedData:
    """Read a LEAF dataset folder as dataset ``name`` (see :data:`LEAF_DATASETS`): one client per
    user, in the order of the training files, with its own train and test samples, on ``device``."""
    if name not in LEAF_DATASETS:
        raise ValueError(f"unknown LEAF dataset {name!r}; available: {', '.join(LEAF_DATASETS)}")
    train_dir, test_dir = _split_folders(data_folder(data_dir))
    train, test = read_leaf_split(train_dir), read_leaf_split(test_dir)
    lonely = [u for u in train if u not in test] or [u for u in test if u not in train]
    if lonely:
        side = test_dir if lonely[0] in train else train_dir
        raise DataError(
            f"{side} has no samples of user {lonely[0]!r}: each LEAF user needs train and test samples "
            "(LEAF's sample split, --t sample; its user split is not read)"
        )
    vocab_size: int | None = None
    if name == "sent140":
        arrays, vocab_size = _sent140(train, test)
        num_classes = 2
    else:
        reader = {"femnist": _femnist, "shakespeare": _shakespeare, "leaf": _numeric}[name]
        arrays = {
            (split, user): reader(x, y, f"{path}: user {user!r}")
            for split, users in (("train", train), ("test", test))
            for user, (x, y, path) in users.items()
        }
        num_classes = {"femnist": FEMNIST_CLASSES, "shakespeare": len(LETTERS)}.get(name, 0)
        if name == "shakespeare":
            vocab_size = len(LETTERS)
    shapes = {a.shape[1:] for a, _ in arrays.values() if len(a)}
    if len(shapes) > 1:
        raise DataError(f"{train_dir.parent}: users' x differ in shape ({', '.join(map(str, sorted(shapes)))})")
    if not shapes:
        raise DataError(f"{train_dir.parent} holds no samples")
    shape = shapes.pop()
    if not num_classes:
        num_classes = max((int(y.max()) for _, y in arrays.values() if y.size), default=0) + 1
    clients = []
    for i, user in enumerate(train):
        tensors = []
        for split in ("train", "test"):
            x, y = arrays[(split, user)]
            x = x if len(x) else np.zeros((0, *shape), dtype=x.dtype)
            tensors += [torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)]
        clients.append(ClientData(i, *tensors))
    return FederatedData.from_clients(clients, num_classes, name=name, vocab_size=vocab_size)

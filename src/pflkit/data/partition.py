"""Splitting a labelled pool among clients (spec §5.2, §5.4, §5.5).

Every function takes its randomness from an explicit generator so that the partition seed stays
separate from model and sampling seeds (§5.8). Two random conventions exist
(``PartitionSpec.rng``): ``"pflkit"`` draws from a ``np.random.Generator`` keyed by the
partition seed; ``"pfllib"`` draws from one legacy ``np.random.RandomState(seed)`` in exactly
the order of PFLlib's generator scripts (``np.random.seed(seed)``, then ``separate_data`` and
``split_data``), so a PFLlib split is reproduced sample for sample from its seed.

The low-level partitioners return one int64 index array per client (sorted; disjoint). Their
parameters carry the names of the config keys, so their messages read as advice to the user of
``pflkit run``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pflkit.data.errors import PartitionError

__all__ = [
    "PARTITION_METHODS",
    "PARTITION_RNGS",
    "ClientSplit",
    "PartitionSpec",
    "class_counts",
    "partition",
    "partition_dirichlet",
    "partition_iid",
    "partition_kfold",
    "partition_label_dirichlet",
    "partition_pathological",
    "pfllib_least_samples",
    "smallest_client",
    "largest_remainder",
    "local_test_sets",
    "split_clients",
    "split_train_test",
    "stratified_test_split",
]

log = logging.getLogger(__name__)

PARTITION_METHODS: tuple[str, ...] = ("iid", "dirichlet", "pathological", "kfold", "label_dirichlet")
PARTITION_RNGS: tuple[str, ...] = ("pflkit", "pfllib")
Rng = np.random.Generator | np.random.RandomState


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise PartitionError(f"labels must be a non-empty 1-d array, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise PartitionError(f"labels must be integers, got dtype {labels.dtype}")
    if labels.min() < 0:
        raise PartitionError(f"labels must be non-negative class ids, found {int(labels.min())}")
    return labels.astype(np.int64, copy=False)


def _check_num_clients(num_clients: int) -> None:
    if num_clients < 1:
        raise PartitionError(f"num_clients must be >= 1, got {num_clients}")


def _sorted(parts: list[np.ndarray] | list[list[int]]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _integers(rng: Rng, low: int, high: int, size: int) -> list[int]:
    if isinstance(rng, np.random.RandomState):
        return rng.randint(low, high, size).tolist()
    return rng.integers(low, high, size=size).tolist()


def smallest_client(train_fraction: float, batch_size: int = 1) -> int:
    """The fewest samples for which the per-client split leaves ``batch_size`` training samples
    (floor(train_fraction * n)) and at least one test sample."""
    if not 0 < train_fraction < 1:
        return max(1, batch_size)
    n = max(2, batch_size)
    while math.floor(train_fraction * n) < batch_size or n - math.floor(train_fraction * n) < 1:
        n += 1
    return n


def pfllib_least_samples(num_samples: int, num_clients: int, batch_size: int, train_fraction: float) -> int:
    """PFLlib's ``least_samples = int(min(batch_size / (1 - train_ratio), |D| / N / 2))``: one test
    batch per client (40 for batch 10 and a 75/25 split) unless the data is too small for it."""
    per_test_batch = batch_size / (1 - train_fraction) if train_fraction < 1 else float(batch_size)
    return int(min(per_test_batch, num_samples / num_clients / 2))


def partition_iid(labels: np.ndarray, num_clients: int, rng: Rng) -> list[np.ndarray]:
    """Shuffle all samples and split them into ``num_clients`` near-equal parts."""
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    if num_clients > len(labels):
        raise PartitionError(
            f"iid partition: num_clients={num_clients} exceeds the {len(labels)} samples; "
            "some clients would get no data; lower num_clients"
        )
    return _sorted(np.array_split(rng.permutation(len(labels)), num_clients))


@dataclass
class _Draw:
    parts: list[list[int]]
    tries: int
    minimum: int
    note: str = ""


def _dirichlet_draws(labels: np.ndarray, num_clients: int, alpha: float, rng: Rng, minimum: int, floor: int,
                     balance_cap: bool, max_retries: int, auto: bool, official: bool = False) -> _Draw:
    """Class-wise Dirichlet draws until the smallest client reaches ``minimum``; after
    ``max_retries`` draws, the draw whose smallest client is largest, if that reaches ``floor``."""
    class_indices = [np.flatnonzero(labels == c) for c in range(int(labels.max()) + 1)]
    n = len(labels)
    average = n / num_clients
    best: list[list[int]] = []
    best_smallest = -1
    for tries in range(1, max_retries + 1):
        buckets: list[list[int]] = [[] for _ in range(num_clients)]
        for idx in class_indices:
            idx = rng.permutation(idx)
            q = rng.dirichlet(np.full(num_clients, alpha))
            if balance_cap:
                open_clients = np.array([len(b) < average for b in buckets])
                capped = q * open_clients
                # If every client is at or above the average (or all remaining mass was on
                # capped clients), PFLlib would divide by zero; we keep the uncapped
                # proportions for this class instead.
                if capped.sum() > 0:
                    q = capped
            q = q / q.sum()
            cuts = (np.cumsum(q) * len(idx)).astype(np.int64)[:-1]
            for bucket, piece in zip(buckets, np.split(idx, cuts)):
                bucket.extend(piece.tolist())
        smallest = min(len(b) for b in buckets)
        if smallest >= minimum:
            return _Draw(buckets, tries, minimum)
        if smallest > best_smallest:
            best, best_smallest = buckets, smallest
    if auto and best_smallest >= floor:
        note = (f"no draw in {max_retries} tries gave every client PFLlib's minimum of {minimum} samples "
                f"(derived from batch_size and train_fraction); kept the draw whose smallest client is largest "
                f"({best_smallest} samples, at least one training batch{'' if official else ' and one test sample'})")
        return _Draw(best, max_retries, best_smallest, note)
    if auto:
        wanted, hint = f"{floor} samples", "lower num_clients or raise alpha (or set min_samples_per_client yourself)"
    elif minimum == 1:
        wanted, hint = "a sample (even min_samples_per_client=0 needs one)", "lower num_clients or raise alpha"
    else:
        wanted, hint = (f"min_samples_per_client={minimum} samples",
                        "lower num_clients, raise alpha, or set min_samples_per_client lower")
    raise PartitionError(
        f"dirichlet partition: no draw in {max_retries} tries gave every one of num_clients={num_clients} clients "
        f"{wanted} with alpha={alpha} (the best draw's smallest client had {best_smallest}); {hint}"
    )


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: Rng,
    *,
    min_samples_per_client: int | None = None,
    balance_cap: bool = True,
    max_retries: int = 1000,
    batch_size: int = 10,
    train_fraction: float = 0.75,
) -> list[np.ndarray]:
    """Class-wise Dirichlet split (PFLlib ``'dir'``, spec §5.4); see :func:`partition`."""
    return _sorted(_dirichlet(labels, num_clients, alpha, rng, min_samples_per_client=min_samples_per_client,
                              balance_cap=balance_cap, max_retries=max_retries, batch_size=batch_size,
                              train_fraction=train_fraction).parts)


def _dirichlet(labels: np.ndarray, num_clients: int, alpha: float, rng: Rng, *,
               min_samples_per_client: int | None, balance_cap: bool, max_retries: int, batch_size: int,
               train_fraction: float, official: bool = False) -> _Draw:
    """For each class, proportions ``q ~ Dir(alpha)`` over clients decide how its shuffled samples
    are cut; with ``balance_cap`` clients already holding the average share get no more. The
    draw is repeated until the smallest client has ``min_samples_per_client`` samples, at most
    ``max_retries`` times.

    ``min_samples_per_client=None`` is PFLlib's ``least_samples`` (:func:`pfllib_least_samples`);
    where no draw reaches it (PFLlib would loop for ever), the draw whose smallest client is
    largest is kept with a logged warning, provided that client still gets one training batch and
    one test sample (:func:`smallest_client`), so small datasets run instead of failing. An
    explicit minimum is never lowered; ``0`` (no minimum) still redraws until no client is empty.
    """
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    n = len(labels)
    if not alpha > 0:
        raise PartitionError(f"dirichlet partition: alpha must be > 0, got {alpha}")
    if max_retries < 1:
        raise PartitionError(f"dirichlet partition: max_retries must be >= 1, got {max_retries}")
    auto = min_samples_per_client is None
    if min_samples_per_client is None:
        minimum = pfllib_least_samples(n, num_clients, batch_size, train_fraction)
        floor = min(minimum, batch_size if official else smallest_client(train_fraction, batch_size))
    else:
        if min_samples_per_client < 0:
            raise PartitionError(f"min_samples_per_client must be >= 0, got {min_samples_per_client}")
        if num_clients * min_samples_per_client > n:
            raise PartitionError(
                f"num_clients={num_clients} x min_samples_per_client={min_samples_per_client} = "
                f"{num_clients * min_samples_per_client} samples, but the dataset holds {n}; lower "
                f"num_clients (at most {n // max(min_samples_per_client, 1)}) or min_samples_per_client"
            )
        # 0 is "no minimum" (FedACD's splits), but an empty client can neither train nor be
        # scored, so draws that leave a client empty are still redrawn.
        minimum = floor = max(min_samples_per_client, 1)
    draw = _dirichlet_draws(labels, num_clients, alpha, rng, minimum, floor, balance_cap, max_retries, auto, official)
    if draw.note:
        log.warning("dirichlet partition (num_clients=%d, alpha=%g, %d samples): %s; set "
                    "min_samples_per_client to choose the minimum", num_clients, alpha, n, draw.note)
    return draw


def partition_pathological(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: Rng,
    *,
    balanced: bool = False,
    min_samples_per_client: int | None = None,
    batch_size: int = 10,
    train_fraction: float = 0.75,
    convention: Literal["pflkit", "pfllib"] = "pflkit",
) -> list[np.ndarray]:
    """Pathological label skew (PFLlib ``'pat'``, spec §5.2); see :func:`_pathological`."""
    return _sorted(_pathological(labels, num_clients, classes_per_client, rng, balanced=balanced,
                                 min_samples_per_client=min_samples_per_client, batch_size=batch_size,
                                 train_fraction=train_fraction, convention=convention))


def _pathological(labels: np.ndarray, num_clients: int, classes_per_client: int, rng: Rng, *,
                  balanced: bool, min_samples_per_client: int | None, batch_size: int, train_fraction: float,
                  convention: str) -> list[list[int]]:
    """Classes are dealt in order to the first ``N / C * n`` clients that still have quota, so
    groups of clients share the same classes (MNIST, N=20, n=2: 5 groups of 4). Each class's
    samples are cut into consecutive chunks: equal sizes if ``balanced``, otherwise random sizes in
    ``[max(m/10, least/C), m)`` with ``m`` the mean chunk size and ``least`` PFLlib's
    ``least_samples`` (or ``min_samples_per_client``); the last client takes the remainder.

    ``convention="pflkit"`` rounds ``N / C * n`` down (the FedALA-era PFLlib) and shuffles each
    class first; ``"pfllib"`` is today's PFLlib: rounded up, each class in pool order.
    """
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    num_classes = int(labels.max()) + 1
    if not 1 <= classes_per_client <= num_classes:
        raise PartitionError(
            f"pathological partition: classes_per_client={classes_per_client} must be in "
            f"1..{num_classes} (the labels hold {num_classes} classes)"
        )
    share = num_clients / num_classes * classes_per_client
    per_class = math.ceil(share) if convention == "pfllib" else int(share)
    if per_class < 1:
        raise PartitionError(
            f"pathological partition: num_clients={num_clients} x classes_per_client="
            f"{classes_per_client} / {num_classes} classes < 1 client per class; "
            "raise num_clients or classes_per_client"
        )
    least = (pfllib_least_samples(len(labels), num_clients, batch_size, train_fraction)
             if min_samples_per_client is None else min_samples_per_client)

    quota = np.full(num_clients, classes_per_client)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        selected = np.flatnonzero(quota > 0)[:per_class]
        if len(selected) == 0:
            break
        idx = np.flatnonzero(labels == c)
        if convention == "pflkit":
            idx = rng.permutation(idx)
        mean = len(idx) / len(selected)
        low, high = int(max(mean / 10, least / num_classes)), int(mean)
        if balanced or low >= high:
            # PFLlib's randint would raise for an empty range; a small class is
            # then split evenly instead.
            sizes = [int(mean)] * (len(selected) - 1)
        else:
            sizes = _integers(rng, low, high, len(selected) - 1)
        sizes.append(len(idx) - sum(sizes))
        start = 0
        for client, size in zip(selected, sizes):
            parts[client].extend(idx[start : start + size].tolist())
            start += size
            quota[client] -= 1

    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise PartitionError(
            f"pathological partition: clients {empty} got no data with num_clients={num_clients}, "
            f"classes_per_client={classes_per_client} and {num_classes} classes: each class goes to "
            f"{per_class} clients, which covers only {per_class * num_classes} of the "
            f"{num_clients * classes_per_client} client-class slots; choose num_clients x "
            "classes_per_client as a multiple of the number of classes"
        )
    return parts


def split_train_test(
    parts: list[np.ndarray], train_fraction: float, rng: Rng, *, convention: str = "pflkit"
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split each client's indices into train/test (spec §5.5, FedALA uses 0.75).

    ``"pflkit"``: each client's samples are shuffled and the first ``floor(train_fraction * n)``
    become training data. ``"pfllib"``: scikit-learn's ``train_test_split(train_size=...,
    shuffle=True)`` on the client's samples in their given order with the ``RandomState``
    ``rng`` (test = the first ceil((1 - train_fraction) n) of the permutation), as PFLlib's
    ``split_data``. Both outputs are sorted.
    """
    if not 0 < train_fraction < 1:
        raise PartitionError(f"train_fraction must be in (0, 1), got {train_fraction}")
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for i, part in enumerate(parts):
        part = np.asarray(part, dtype=np.int64)
        n_train = math.floor(train_fraction * len(part))
        if n_train == 0 or n_train == len(part):
            need = smallest_client(train_fraction)
            raise PartitionError(
                f"client {i} got {len(part)} sample(s): too few to split into training and test data at "
                f"train_fraction={train_fraction} (a client needs at least {need}); set "
                "min_samples_per_client, lower num_clients or raise alpha"
            )
        if convention == "pfllib":
            from sklearn.model_selection import train_test_split

            if not isinstance(rng, np.random.RandomState):
                raise TypeError("the pfllib split convention draws from a np.random.RandomState")
            try:
                tr, te = train_test_split(part, train_size=train_fraction, shuffle=True, random_state=rng)
            except ValueError as exc:
                raise PartitionError(f"client {i}: scikit-learn cannot split {len(part)} samples at "
                                     f"train_fraction={train_fraction} ({exc})") from None
        else:
            shuffled = rng.permutation(part)
            tr, te = shuffled[:n_train], shuffled[n_train:]
        train.append(np.sort(tr))
        test.append(np.sort(te))
    return train, test


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-client label histogram, int64 of shape ``[num_clients, num_classes]``."""
    labels = np.asarray(labels)
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for i, part in enumerate(parts):
        client_labels = labels[np.asarray(part, dtype=np.int64)]
        if client_labels.size and (client_labels.min() < 0 or client_labels.max() >= num_classes):
            raise ValueError(
                f"class_counts: client {i} has labels outside 0..{num_classes - 1}"
            )
        counts[i] = np.bincount(client_labels, minlength=num_classes)
    return counts


class PartitionSpec(BaseModel):
    """How to split a pool over clients: the ``[partition]`` section of the experiment config
    (its flat keys ``partition``, ``partition_rng``, ``partition_seed``, ``num_clients``, ...
    are aliases of these fields, see ``pflkit.config.FLAT_KEYS``).

    The training batch size, which PFLlib's default minimum reads, is the run's ``[train]``
    setting: it is given where the partition is drawn (:func:`split_clients`), not kept here."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    method: Literal[PARTITION_METHODS] = Field(  # type: ignore[valid-type]
        "dirichlet", description="iid; dirichlet (class-wise, PFLlib, spec §5.4); pathological (spec §5.2); "
        "kfold (SosicFL's k-Fold groups, spec §5.3); label_dirichlet (client-wise Dir over label "
        "distributions with equal client sizes, SosicFL, spec §5.6)")
    num_clients: int = Field(20, ge=1)
    alpha: float = Field(0.1, gt=0, description="Dirichlet concentration (spec §5.4; label_dirichlet: §5.6)")
    classes_per_client: int = Field(2, ge=1, description="pathological: classes per client (spec §5.2)")
    balanced: bool = Field(False, description="pathological: equal shares instead of PFLlib's random sizes")
    min_samples_per_client: int | None = Field(
        None, ge=0, description="dirichlet/pathological minimum samples per client; default PFLlib's "
        "int(min(batch_size / (1 - train_fraction), samples / num_clients / 2)), lowered with a logged "
        "warning to one training batch + one test sample where no draw reaches it (spec §5.4)")
    balance_cap: bool = Field(True, description="dirichlet: stop feeding clients that hold the average share "
                              "(PFLlib; spec §5.4 [UNCERTAIN] for FedACD's splits)")
    train_fraction: float = Field(0.75, gt=0, lt=1, description="per-client train share (spec §5.5; "
                                  "test_set = client_split only)")
    rng: Literal[PARTITION_RNGS] = Field(  # type: ignore[valid-type]
        "pflkit", description="random convention of the partition: pflkit's seeded streams, or PFLlib's "
        "np.random.seed(partition seed) order, which reproduces PFLlib's generated split of the same pool")
    seed: int | None = Field(None, description="seed of the partition; default: each run seed")
    max_retries: int = Field(1000, ge=1, description="dirichlet: draws tried for the minimum client size")
    num_folds: int = Field(2, ge=1, description="kfold: G groups of clients and of primary classes")
    primary_fraction: float = Field(0.8, gt=0, le=1, description="kfold: share of a client's samples from its "
                                    "group's primary classes (the rest spread evenly over the others)")
    test_set: Literal["client_split", "official"] = Field(
        "client_split", description="client_split: every client's samples split train/test (FedALA, spec §5.5); "
        "official: the official training split is partitioned, the official test split is the global test "
        "set and each client gets a local test set with its label proportions (spec §5.6)")

    @property
    def official(self) -> bool:
        return self.test_set == "official"

    def seed_for(self, run_seed: int) -> int:
        """The partition seed of run seed ``run_seed`` (``seed`` fixes it across run seeds)."""
        return run_seed if self.seed is None else self.seed

    def generator(self, seed: int) -> Rng:
        """The partition's random source for ``seed`` (see the module docstring)."""
        if self.rng == "pfllib":
            return np.random.RandomState(seed)
        from pflkit.functional.streams import numpy_generator

        return numpy_generator(seed, "partition")


@dataclass
class ClientSplit:
    """Per-client training and test indices into the pool, and how they were obtained."""

    train: list[np.ndarray]
    test: list[np.ndarray]
    info: dict[str, Any] = field(default_factory=dict)


def partition(labels: np.ndarray, *, method: str, num_clients: int, rng: Rng, alpha: float = 0.1,
              classes_per_client: int = 2, balanced: bool = False, min_samples_per_client: int | None = None,
              balance_cap: bool = True, batch_size: int = 10, train_fraction: float = 0.75,
              max_retries: int = 1000) -> list[np.ndarray]:
    """Dispatch to the partition ``method`` (one of :data:`PARTITION_METHODS`); sorted parts."""
    if method not in PARTITION_METHODS:
        raise PartitionError(f"unknown partition method {method!r}; available: {', '.join(PARTITION_METHODS)}")
    return _sorted(_partition(labels, PartitionSpec(
        method=method, num_clients=num_clients, alpha=alpha, classes_per_client=classes_per_client,
        balanced=balanced, min_samples_per_client=min_samples_per_client, balance_cap=balance_cap,
        train_fraction=train_fraction, max_retries=max_retries), rng, batch_size).parts)


def _partition(labels: np.ndarray, spec: PartitionSpec, rng: Rng, batch_size: int) -> _Draw:
    """Parts in draw order (the pfllib split convention depends on it) and the minimum used;
    ``batch_size`` (the run's training batch) sizes PFLlib's default minimum."""
    labels = _check_labels(labels)
    _check_num_clients(spec.num_clients)
    n = len(labels)
    viable = 1 if spec.official else smallest_client(spec.train_fraction)
    if spec.num_clients * viable > n:
        need = "one training sample" if spec.official else \
            f"{viable}: one to train and one to test at train_fraction={spec.train_fraction}"
        raise PartitionError(
            f"num_clients={spec.num_clients} needs at least {spec.num_clients * viable} samples (every client "
            f"needs {need}), but the {'official training split' if spec.official else 'dataset'} holds {n}; "
            f"lower num_clients to at most {n // viable}"
        )
    pathological = dict(balanced=spec.balanced, min_samples_per_client=spec.min_samples_per_client,
                        batch_size=batch_size, train_fraction=spec.train_fraction,
                        convention=spec.rng)
    if spec.method == "iid":
        if spec.rng == "pfllib":  # PFLlib's iid is its pathological rule with every class
            parts = _pathological(labels, spec.num_clients, int(labels.max()) + 1, rng, **pathological)
        else:
            parts = [p.tolist() for p in np.array_split(rng.permutation(n), spec.num_clients)]
        return _Draw(parts, 1, min(len(p) for p in parts))
    if spec.method == "dirichlet":
        return _dirichlet(labels, spec.num_clients, spec.alpha, rng,
                          min_samples_per_client=spec.min_samples_per_client, balance_cap=spec.balance_cap,
                          max_retries=spec.max_retries, batch_size=batch_size,
                          train_fraction=spec.train_fraction, official=spec.official)
    if spec.method == "pathological":
        parts = _pathological(labels, spec.num_clients, spec.classes_per_client, rng, **pathological)
        return _Draw(parts, 1, min(len(p) for p in parts))
    if spec.method == "kfold":
        parts = partition_kfold(labels, spec.num_clients, spec.num_folds, rng, primary_fraction=spec.primary_fraction)
        return _Draw([p.tolist() for p in parts], 1, min(len(p) for p in parts))
    if spec.method == "label_dirichlet":
        parts = partition_label_dirichlet(labels, spec.num_clients, spec.alpha, rng)
        return _Draw([p.tolist() for p in parts], 1, min(len(p) for p in parts))
    raise AssertionError(f"unreachable: PartitionSpec admits no method {spec.method!r}")


def split_clients(labels: np.ndarray, spec: PartitionSpec, seed: int,
                  pools: tuple[np.ndarray, np.ndarray] | None = None, *, batch_size: int = 10) -> ClientSplit:
    """Partition ``labels`` by ``spec`` with the partition seed ``seed`` (``spec.seed_for(run
    seed)``) and give every client its training and test indices; ``info`` records what was done.
    ``batch_size`` is the run's training batch size, which PFLlib's default minimum client size
    reads (``min_samples_per_client`` unset).

    ``client_split``: the whole pool is partitioned and every client's samples are split into
    training and test data (spec §5.5). ``official``: ``pools`` = (official training rows,
    official test rows); only the training rows are partitioned (each client trains on its whole
    part) and each client's test data is a local test set drawn from the official test rows with
    its training label proportions (:func:`local_test_sets`, spec §5.6).
    """
    rng = spec.generator(seed)
    if spec.official:
        if pools is None:
            raise ValueError("the official test-set protocol needs the official training and test rows")
        train_pool, test_pool = (np.asarray(p, dtype=np.int64) for p in pools)
        draw = _partition(labels[train_pool], spec, rng, batch_size)
        train = _sorted([train_pool[np.asarray(p, dtype=np.int64)] for p in draw.parts])
        empty = [i for i, t in enumerate(train) if len(t) == 0]
        if empty:
            raise PartitionError(f"clients {empty[:10]} got no training sample; set min_samples_per_client to "
                                 "at least 1, lower num_clients or raise alpha")
        num_classes = int(labels.max()) + 1
        counts = class_counts(labels, train, num_classes)
        size = len(test_pool) // spec.num_clients
        test = [test_pool[t] for t in local_test_sets(counts, labels[test_pool], size, rng)]
        info = {"method": spec.method, "rng": spec.rng, "partition_seed": seed, "tries": draw.tries,
                "min_samples_per_client": draw.minimum, "test_set": "official", "local_test_size": size,
                "global_test_size": len(test_pool)}
    else:
        draw = _partition(labels, spec, rng, batch_size)
        parts = [np.asarray(p, dtype=np.int64) for p in draw.parts]
        if spec.rng == "pflkit":
            parts = _sorted(parts)
        train, test = split_train_test(parts, spec.train_fraction, rng, convention=spec.rng)
        info = {"method": spec.method, "rng": spec.rng, "partition_seed": seed, "tries": draw.tries,
                "min_samples_per_client": draw.minimum, "test_set": "client_split"}
    if draw.note:
        info["fallback"] = draw.note
    return ClientSplit(train, test, info)


def partition_kfold(labels: np.ndarray, num_clients: int, num_folds: int, rng: Rng, *,
                    primary_fraction: float = 0.8) -> list[np.ndarray]:
    """SosicFL's k-Fold groups (spec §5.3 [RECON]): classes and clients are cut into ``num_folds``
    groups; every client of group g holds n = floor(N / K) samples, ``primary_fraction`` of them
    spread evenly over g's primary classes and the rest evenly over the other classes, with the
    same largest-remainder counts for the whole group, so a group's clients have identical label
    distributions. Samples are drawn without replacement; where a class cannot feed every client
    n shrinks (logged). Clients are numbered group by group."""
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    num_classes = int(labels.max()) + 1
    if not 1 <= num_folds <= min(num_classes, num_clients):
        raise PartitionError(f"kfold partition: num_folds={num_folds} must be in 1..{min(num_classes, num_clients)} "
                             f"(at most the {num_classes} classes and num_clients={num_clients})")
    if not 0 < primary_fraction <= 1:
        raise PartitionError(f"kfold partition: primary_fraction must be in (0, 1], got {primary_fraction}")
    primaries = np.array_split(np.arange(num_classes), num_folds)
    groups = np.array_split(np.arange(num_clients), num_folds)
    available = np.bincount(labels, minlength=num_classes)

    def quotas(n: int) -> list[np.ndarray]:
        out = []
        for primary in primaries:
            shares = np.zeros(num_classes)
            others = num_classes - len(primary)
            shares[primary] = (primary_fraction if others else 1.0) / len(primary)
            if others:
                shares[np.setdiff1d(np.arange(num_classes), primary)] = (1 - primary_fraction) / others
            out.append(largest_remainder(shares, n))
        return out

    n = len(labels) // num_clients
    while n > 0:
        need = sum(len(g) * q for g, q in zip(groups, quotas(n)))
        if np.all(need <= available):
            break
        n -= 1
    if n == 0:
        raise PartitionError(f"kfold partition: the classes cannot give num_clients={num_clients} clients one "
                             "sample each with these groups; lower num_clients or num_folds")
    if n < len(labels) // num_clients:
        log.warning("kfold partition: classes too small for %d samples per client; every client gets %d",
                    len(labels) // num_clients, n)
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
    parts: list[np.ndarray] = []
    for group, quota in zip(groups, quotas(n)):
        for _ in group:
            taken = []
            for c in np.flatnonzero(quota):
                taken += pools[c][:quota[c]]
                del pools[c][:quota[c]]
            parts.append(np.asarray(taken, dtype=np.int64))
    return parts


def partition_label_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, rng: Rng) -> list[np.ndarray]:
    """Client-wise Dirichlet over label distributions with equal client sizes (SosicFL, spec §5.6
    [RECON]): phi_k ~ Dir(alpha 1_L), n = floor(N / K), class counts by largest remainder of
    n phi_k, drawn without replacement; a class pool that runs dry passes the client's deficit to
    its other classes in proportion to phi_k (to any class with samples left where those are dry)."""
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    if not alpha > 0:
        raise PartitionError(f"label_dirichlet partition: alpha must be > 0, got {alpha}")
    num_classes = int(labels.max()) + 1
    n = len(labels) // num_clients
    if n == 0:
        raise PartitionError(f"label_dirichlet partition: num_clients={num_clients} exceeds the {len(labels)} "
                             "samples; lower num_clients")
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
    parts = []
    for _ in range(num_clients):
        phi = rng.dirichlet(np.full(num_classes, alpha))
        want = largest_remainder(phi, n)
        taken: list[int] = []
        while True:
            left = np.array([len(p) for p in pools])
            got = np.minimum(want, left)
            for c in np.flatnonzero(got):
                taken += pools[c][:got[c]]
                del pools[c][:got[c]]
            deficit = int((want - got).sum())
            if deficit == 0:
                break
            left = np.array([len(p) for p in pools])
            weights = np.where(left > 0, phi, 0.0)
            if weights.sum() <= 0:
                weights = (left > 0).astype(np.float64)
            want = largest_remainder(weights, deficit)  # only classes with samples left: each pass takes some
        parts.append(np.asarray(taken, dtype=np.int64))
    return parts


def largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total`` in proportion to ``shares`` (largest remainder rule;
    ties go to the lower index)."""
    shares = np.asarray(shares, dtype=np.float64)
    exact = shares / shares.sum() * total
    counts = np.floor(exact).astype(np.int64)
    remainder = exact - counts
    order = sorted(range(len(shares)), key=lambda i: (-remainder[i], i))
    counts[order[:total - int(counts.sum())]] += 1
    return counts


def local_test_sets(train_counts: np.ndarray, test_labels: np.ndarray, size: int, rng: Rng) -> list[np.ndarray]:
    """Per client, ``size`` positions of the test pool whose labels follow the client's training
    label proportions (largest remainder counts, spec §5.6 [RECON]). Within a client each class
    is drawn without replacement (with replacement where the pool holds fewer); clients may share
    test samples."""
    num_classes = train_counts.shape[1]
    pools = [np.flatnonzero(test_labels == c) for c in range(num_classes)]
    out = []
    for i, counts in enumerate(train_counts):
        quota = largest_remainder(counts, size)
        chosen = []
        for c in np.flatnonzero(quota):
            if len(pools[c]) == 0:
                raise PartitionError(f"client {i} trains on class {c}, of which the official test split holds no "
                                     "sample: no local test set can follow its label distribution")
            chosen.append(rng.choice(pools[c], size=int(quota[c]), replace=bool(quota[c] > len(pools[c]))))
        out.append(np.sort(np.concatenate(chosen)) if chosen else np.empty(0, dtype=np.int64))
    return out


def stratified_test_split(labels: np.ndarray, test_fraction: float = 0.25,
                          seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A fixed stratified split (training rows, test rows) for datasets without an official one."""
    from sklearn.model_selection import train_test_split

    rows = np.arange(len(labels))
    train, test = train_test_split(rows, test_size=test_fraction, stratify=labels, random_state=seed)
    return np.sort(train), np.sort(test)

"""PFLlib's ``'exdir'`` rule (from Li et al., arXiv 2311.03154): every client draws
``classes_per_client`` classes, then each class's samples are cut by Dir(alpha) proportions among
the clients holding it, with PFLlib's balance cap and its rule that a class's rounding remainder
goes to its last holder. The class draw is repeated until every class has
``max(C x N // classes // 2, 1)`` holders, the sample draw until every client has 10 samples
(PFLlib's ``min_require_size``; ``min_samples_per_client`` where set), each at most
``max_retries`` times; finally each client's samples are shuffled, as PFLlib does before its
train/test split.
"""

from __future__ import annotations

import logging

import numpy as np

from .spec import PartitionError, Rng, _check_labels, _check_num_clients, _Draw, _sorted, smallest_client

__all__ = ["PFLLIB_EXDIR_MINIMUM", "partition_exdir"]

log = logging.getLogger(__name__)

#: PFLlib's ``min_require_size`` of the exdir rule.
PFLLIB_EXDIR_MINIMUM = 10


def _holders(num_clients: int, num_classes: int, per_client: int, rng: Rng, max_retries: int) -> list[list[int]]:
    """Per class, the clients (in increasing order) that drew it; redrawn until every class has
    ``max(C x N // classes // 2, 1)`` of them."""
    need = max(per_client * num_clients // num_classes // 2, 1)
    for _ in range(max_retries):
        holders: list[list[int]] = [[] for _ in range(num_classes)]
        for client in range(num_clients):
            for k in rng.choice(num_classes, per_client, replace=False):
                holders[int(k)].append(client)
        if min(len(h) for h in holders) >= need:
            return holders
    raise PartitionError(
        f"exdir partition: no draw in {max_retries} tries of classes_per_client={per_client} classes for each of "
        f"num_clients={num_clients} clients gave every one of the {num_classes} classes {need} clients; "
        "raise num_clients or classes_per_client"
    )


def _cuts(q: np.ndarray, open_: np.ndarray, held: np.ndarray, size: int, last: int, convention: str) -> np.ndarray:
    """Where a class of ``size`` shuffled samples is cut among the clients (PFLlib's arithmetic)."""
    p = q * open_
    if p.sum() <= 0:
        if convention == "pfllib":
            # PFLlib divides by zero here; its NaN cuts then hand the whole class to the last holder
            return np.where(np.arange(len(q) - 1) < last, 0, size).astype(np.int64)
        p = q * held if (q * held).sum() > 0 else held.astype(np.float64)  # the holders, uncapped
    cuts = (np.cumsum(p / p.sum()) * size).astype(np.int64)[:-1]
    if len(cuts) and cuts[-1] != size:  # the rounding remainder goes to the class's last holder
        cuts[last:] = size
    return cuts


def _exdir(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    alpha: float,
    rng: Rng,
    *,
    min_samples_per_client: int | None = None,
    balance_cap: bool = True,
    max_retries: int = 1000,
    train_fraction: float = 0.75,
    official: bool = False,
    convention: str = "pflkit",
) -> _Draw:
    """The exdir draw (see the module docstring); parts in PFLlib's order. Where the default
    minimum of 10 is out of reach, the draw whose smallest client is largest is kept with a logged
    warning if every client can still train and test on it; an explicit minimum is
    never lowered. Where every holder of a class is capped, PFLlib's arithmetic gives the class to
    its last holder (``rng = "pfllib"``); pflkit's convention cuts it among its holders uncapped."""
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    n, num_classes = len(labels), int(labels.max()) + 1
    if not 1 <= classes_per_client <= num_classes:
        raise PartitionError(
            f"exdir partition: classes_per_client={classes_per_client} must be in 1..{num_classes} "
            f"(the labels hold {num_classes} classes)"
        )
    if num_clients * classes_per_client < num_classes:
        raise PartitionError(
            f"exdir partition: num_clients={num_clients} x classes_per_client={classes_per_client} < "
            f"{num_classes} classes, so some class has no client; raise num_clients or classes_per_client"
        )
    if not alpha > 0:
        raise PartitionError(f"exdir partition: alpha must be > 0, got {alpha}")
    if max_retries < 1:
        raise PartitionError(f"exdir partition: max_retries must be >= 1, got {max_retries}")
    auto = min_samples_per_client is None
    minimum = PFLLIB_EXDIR_MINIMUM if min_samples_per_client is None else max(min_samples_per_client, 1)
    if not auto and num_clients * minimum > n:
        raise PartitionError(
            f"exdir partition: num_clients={num_clients} x min_samples_per_client={minimum} exceeds the "
            f"{n} samples; lower num_clients or min_samples_per_client"
        )
    floor = min(minimum, 1 if official else smallest_client(train_fraction))  # PFLlib's 10 is below a batch anyway
    holders = _holders(num_clients, num_classes, classes_per_client, rng, max_retries)
    member = np.zeros((num_classes, num_clients), dtype=bool)
    for k, h in enumerate(holders):
        member[k, h] = True
    best: list[list[int]] = []
    note, tries = "", 0
    while tries < max_retries:
        tries += 1
        buckets: list[list[int]] = [[] for _ in range(num_clients)]
        for k in range(num_classes):
            idx = rng.permutation(np.flatnonzero(labels == k))
            q = rng.dirichlet(np.full(num_clients, alpha))
            sizes = np.array([len(b) for b in buckets])
            open_ = member[k] & (sizes < n / num_clients) if balance_cap else member[k]
            cuts = _cuts(q, open_, member[k], len(idx), holders[k][-1], convention)
            for bucket, piece in zip(buckets, np.split(idx, cuts)):
                bucket.extend(piece.tolist())
        smallest = min(len(b) for b in buckets)
        if smallest > (min(len(b) for b in best) if best else -1):
            best = buckets
        if smallest >= minimum:
            break
    else:
        smallest = min(len(b) for b in best)
        if not (auto and smallest >= floor):
            raise PartitionError(
                f"exdir partition: no draw in {max_retries} tries gave every one of num_clients={num_clients} "
                f"clients {minimum if auto else f'min_samples_per_client={minimum}'} samples with alpha={alpha} "
                f"and classes_per_client={classes_per_client} (the best draw's smallest client had {smallest}); "
                "lower num_clients, raise alpha or classes_per_client"
                + ("" if auto else ", or set min_samples_per_client lower")
            )
        note = (
            f"no draw in {max_retries} tries gave every client PFLlib's minimum of {minimum} samples; kept the "
            f"draw whose smallest client is largest ({smallest} samples)"
        )
        log.warning(
            "exdir partition (num_clients=%d, %d samples): %s; set min_samples_per_client to choose the minimum",
            num_clients,
            n,
            note,
        )
        buckets, minimum = best, smallest
    for bucket in buckets:
        rng.shuffle(bucket)
    return _Draw(buckets, tries, minimum, note)


def partition_exdir(
    labels: np.ndarray, num_clients: int, classes_per_client: int, alpha: float, rng: Rng, **kw: object
) -> list[np.ndarray]:
    """PFLlib's exdir split, each client's indices sorted; keywords as :func:`_exdir`."""
    return _sorted(_exdir(labels, num_clients, classes_per_client, alpha, rng, **kw).parts)  # type: ignore[arg-type]

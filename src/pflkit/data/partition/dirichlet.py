"""Class-wise Dirichlet label skew, PFLlib's ``'dir'`` rule.

Each class's samples are cut among the clients by proportions drawn from Dir(alpha), with PFLlib's
balance cap; whole draws are repeated until the smallest client reaches the minimum (PFLlib's
``least_samples`` by default, or ``min_samples_per_client``), at most ``max_retries`` times, with
a logged fallback to the best draw where the default minimum is out of reach.
"""

from __future__ import annotations

import logging

import numpy as np

from .spec import (
    PartitionError,
    Rng,
    _check_labels,
    _check_num_clients,
    _Draw,
    _sorted,
    pfllib_least_samples,
    smallest_client,
)

__all__ = ["partition_dirichlet"]

log = logging.getLogger(__name__)


def _dirichlet_draws(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: Rng,
    minimum: int,
    floor: int,
    balance_cap: bool,
    max_retries: int,
    auto: bool,
    official: bool = False,
) -> _Draw:
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
        note = (
            f"no draw in {max_retries} tries gave every client PFLlib's minimum of {minimum} samples "
            f"(derived from batch_size and train_fraction); kept the draw whose smallest client is largest "
            f"({best_smallest} samples, at least one training batch{'' if official else ' and one test sample'})"
        )
        return _Draw(best, max_retries, best_smallest, note)
    if auto:
        wanted, hint = f"{floor} samples", "lower num_clients or raise alpha (or set min_samples_per_client yourself)"
    elif minimum == 1:
        wanted, hint = "a sample (even min_samples_per_client=0 needs one)", "lower num_clients or raise alpha"
    else:
        wanted, hint = (
            f"min_samples_per_client={minimum} samples",
            "lower num_clients, raise alpha, or set min_samples_per_client lower",
        )
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
    """Class-wise Dirichlet split (PFLlib ``'dir'``); see :func:`_dirichlet`."""
    return _sorted(
        _dirichlet(
            labels,
            num_clients,
            alpha,
            rng,
            min_samples_per_client=min_samples_per_client,
            balance_cap=balance_cap,
            max_retries=max_retries,
            batch_size=batch_size,
            train_fraction=train_fraction,
        ).parts
    )


def _dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: Rng,
    *,
    min_samples_per_client: int | None,
    balance_cap: bool,
    max_retries: int,
    batch_size: int,
    train_fraction: float,
    official: bool = False,
) -> _Draw:
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
        log.warning(
            "dirichlet partition (num_clients=%d, alpha=%g, %d samples): %s; set "
            "min_samples_per_client to choose the minimum",
            num_clients,
            alpha,
            n,
            draw.note,
        )
    return draw

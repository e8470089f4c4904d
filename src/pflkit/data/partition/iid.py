"""IID partition: the pool shuffled and cut into near-equal parts, one per client (the baseline
next to the label skews of :mod:`.pathological` and :mod:`.dirichlet`).

This is the ``"pflkit"`` convention. Under ``rng = "pfllib"``, :func:`pflkit.data.partition.split_clients`
draws IID as PFLlib does: its pathological rule (:mod:`.pathological`) with every class.
"""

from __future__ import annotations

import numpy as np

from .spec import PartitionError, Rng, _check_labels, _check_num_clients, _sorted

__all__ = ["partition_iid"]


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

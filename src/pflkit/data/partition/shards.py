"""FedAvg's pathological non-IID split (McMahan et al. 2017): the pool sorted by label, cut into
``num_clients x shards_per_client`` shards of near-equal size, each client given
``shards_per_client`` shards at random.

PFLlib has no shards rule; under ``rng = "pfllib"`` the same steps draw from its ``RandomState``.
"""

from __future__ import annotations

import numpy as np

from .spec import PartitionError, Rng, _check_labels, _check_num_clients

__all__ = ["partition_shards"]


def partition_shards(labels: np.ndarray, num_clients: int, shards_per_client: int, rng: Rng) -> list[np.ndarray]:
    """Every sample goes to exactly one client; client sizes differ by at most ``shards_per_client``
    (shards hold floor or ceil of n / shards samples). Within a class the samples are shuffled
    first, so a shard is a random set of its class's samples; a shard spans two classes only where
    a class boundary falls inside it. Clients come in the order of the shard draw (client i gets
    the shards at positions i*s .. i*s + s - 1 of a random permutation)."""
    labels = _check_labels(labels)
    _check_num_clients(num_clients)
    if shards_per_client < 1:
        raise PartitionError(f"shards partition: shards_per_client must be >= 1, got {shards_per_client}")
    num_shards = num_clients * shards_per_client
    if num_shards > len(labels):
        raise PartitionError(
            f"shards partition: num_clients={num_clients} x shards_per_client={shards_per_client} = "
            f"{num_shards} shards, but the pool holds {len(labels)} samples (a shard needs one); lower "
            f"num_clients or shards_per_client (at most {len(labels) // num_clients} shards per client)"
        )
    shuffled = rng.permutation(len(labels))
    by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
    shards = np.array_split(by_label, num_shards)
    order = rng.permutation(num_shards)
    return [
        np.concatenate([shards[j] for j in order[i * shards_per_client : (i + 1) * shards_per_client]])
        for i in range(num_clients)
    ]

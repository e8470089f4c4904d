"""Clients of a multi-domain dataset (Digit-5, Office-Caltech-10, DomainNet): one per domain, or
``clients_per_domain`` per domain.

With ``m = clients_per_domain > 1`` each domain's training images are shuffled (from the partition
seed and the domain's name) and cut into ``m`` near-equal IID parts, and its test images likewise:
client ``j`` of a domain holds part ``j`` of both. Clients are numbered domain by domain
(domain ``d``'s clients are ``d * m .. d * m + m - 1``). The partition record keeps each client's
domain under ``domains`` (``{"domain": name, "label": name}``, the shape of the feature-shift
record, so the partition plot names them) and the clients of ``heldout_domains`` under
``heldout_clients`` (:func:`heldout_client_ids`): clients meant to be evaluated as newcomers on a
domain that no training client holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pflkit.data.domain_sets import DomainOptions, DomainSplit, read_domains
from pflkit.data.errors import DataError
from pflkit.data.federated import ClientData, FederatedData
from pflkit.functional.streams import numpy_generator

__all__ = ["domain_clients", "heldout_client_ids", "load_domain_clients"]


def _parts(n: int, m: int, seed: int, domain: str, split: str) -> list[np.ndarray]:
    if m == 1:
        return [np.arange(n)]
    order = numpy_generator(seed, "domain-clients", domain, split).permutation(n)
    return [np.sort(p) for p in np.array_split(order, m)]


def domain_clients(
    splits: list[DomainSplit],
    num_classes: int,
    dataset: str,
    options: DomainOptions,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> FederatedData:
    """The clients of the domains ``splits`` (see the module docstring), partition seed ``seed``."""
    m = options.clients_per_domain
    if m < 1:
        raise DataError(f"clients_per_domain must be at least 1, got {m}")
    used = [s.name for s in splits]
    lost = [d for d in options.heldout_domains if d not in used]
    if lost:
        raise DataError(f"heldout domain {lost[0]!r} is not among the domains read ({', '.join(used)})")
    if splits and set(options.heldout_domains) >= set(used):
        raise DataError(f"every domain ({', '.join(used)}) is held out: no client would train")
    clients: list[ClientData] = []
    records: list[dict[str, str]] = []
    heldout: list[int] = []
    for s in splits:
        for split, labels in (("training", s.train_y), ("test", s.test_y)):
            if len(labels) < m:
                raise DataError(
                    f"{dataset}: domain {s.name!r} has {len(labels)} {split} images, fewer than "
                    f"clients_per_domain = {m}"
                )
        train = _parts(len(s.train_y), m, seed, s.name, "train")
        test = _parts(len(s.test_y), m, seed, s.name, "test")
        for tr, te in zip(train, test):
            cid = len(clients)
            tr_t, te_t = torch.from_numpy(tr), torch.from_numpy(te)
            whole = m == 1  # the domain's own tensors, not a copy
            tensors = (
                (s.train_x, s.train_y, s.test_x, s.test_y)
                if whole
                else (s.train_x[tr_t], s.train_y[tr_t], s.test_x[te_t], s.test_y[te_t])
            )
            clients.append(ClientData(cid, *(t.to(device) for t in tensors)))
            records.append({"domain": s.name, "label": s.name})
            if s.name in options.heldout_domains:
                heldout.append(cid)
    if not clients:
        raise DataError(f"{dataset}: no domains read")
    fed = FederatedData.from_clients(clients, num_classes, name=dataset)
    fed.partition_info = {
        "partition": "domains",
        "clients_per_domain": m,
        "domain_split": "iid" if m > 1 else "whole",
        "domains": records,
        "heldout_domains": list(options.heldout_domains),
        "heldout_clients": heldout,
    }
    return fed


def heldout_client_ids(fed: FederatedData) -> list[int]:
    """The ids of the clients of the held-out domains (``data.heldout_domains``); empty for other data."""
    return [int(i) for i in fed.partition_info.get("heldout_clients", [])]


def load_domain_clients(
    dataset: str,
    data_dir: str | Path,
    options: DomainOptions,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> FederatedData:
    """Read ``dataset``'s domains from ``data_dir`` and make their clients (partition seed ``seed``)."""
    splits, num_classes = read_domains(dataset, data_dir, options)
    return domain_clients(splits, num_classes, dataset, options, seed, device)

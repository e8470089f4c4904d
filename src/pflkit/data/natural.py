"""Datasets that arrive with their own clients (natural or generated per client): PFLlib folders,
LEAF's JSON sets, the multi-domain sets (a client per domain) and FedProx's Synthetic(alpha, beta).
No label partition is drawn for them."""

from __future__ import annotations

from pathlib import Path

import torch

from pflkit.data.domain_clients import load_domain_clients
from pflkit.data.domain_sets import DOMAIN_DATASETS, DomainOptions
from pflkit.data.errors import DataError
from pflkit.data.federated import FederatedData
from pflkit.data.fedprox_synthetic import fedprox_synthetic
from pflkit.data.leaf import LEAF_DATASETS, load_leaf
from pflkit.data.pfllib import load_pfllib

__all__ = ["ADOPTED_CLIENTS", "NATURAL_DATASETS", "load_clients"]

#: datasets whose clients come with the data (the config's num_clients is replaced by theirs)
ADOPTED_CLIENTS: tuple[str, ...] = ("pfllib", *LEAF_DATASETS, *DOMAIN_DATASETS)
#: every dataset read or generated client by client (fedprox_synthetic: num_clients clients)
NATURAL_DATASETS: tuple[str, ...] = (*ADOPTED_CLIENTS, "fedprox_synthetic")


def load_clients(
    name: str,
    data_dir: str | Path | None,
    *,
    num_clients: int = 30,
    seed: int = 0,
    alpha: float = 1.0,
    beta: float = 1.0,
    iid: bool = False,
    device: torch.device | str = "cpu",
    domains: DomainOptions | None = None,
) -> FederatedData:
    """The clients of dataset ``name`` (one of :data:`NATURAL_DATASETS`) on ``device``.

    ``num_clients``, ``seed``, ``alpha``, ``beta`` and ``iid`` are Synthetic(alpha, beta)'s (the
    others read their clients from ``data_dir``); ``domains``: what a multi-domain dataset reads
    and how its domains become clients (``seed`` shuffles a domain split over several clients)."""
    if name == "fedprox_synthetic":
        return fedprox_synthetic(num_clients, alpha, beta, iid=iid, seed=seed, device=device)
    if name not in ADOPTED_CLIENTS:
        raise ValueError(f"{name!r} has no natural clients; those that do: {', '.join(NATURAL_DATASETS)}")
    if data_dir is None:
        raise DataError(f"dataset {name!r} needs data_dir: the folder that holds its files")
    if name in DOMAIN_DATASETS:
        return load_domain_clients(name, data_dir, domains or DomainOptions(), seed=seed, device=device)
    if name == "pfllib":
        return load_pfllib(data_dir, device=device)
    return load_leaf(data_dir, name, device=device)

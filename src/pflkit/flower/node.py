"""What a Flower node needs to run pflkit client functions: config, its data, model, state."""

from __future__ import annotations

import functools
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..algorithms import Algorithm, TrainSettings
from ..config import BaseConfig, build_config
from ..data import NATURAL_DATASETS, DataError
from ..data.domains import apply_feature_shift
from ..data.federated import ClientData, FederatedData
from ..engines.base import RoundSetup
from ..federation.evaluation import local_model_metrics
from ..federation.preparation import (
    initial_params,
    load_pool,
    natural_clients,
    partition_dataset,
    partition_seed,
    resolve_device,
)
from ..functional import to_device
from ..methods import build_algorithm
from ..models import UnitModel

NUM_CLASSES = {
    "digits": 10,
    "mnist": 10,
    "synthetic": 10,
    "cifar10": 10,
    "cifar100": 100,
    "tiny_imagenet": 200,
    "agnews": 4,
    "fashion_mnist": 10,
    "svhn": 10,
    "usps": 10,
    "cinic10": 10,
}


@functools.lru_cache(maxsize=8)
def config_from_text(text: str) -> BaseConfig:
    """The config a ServerApp sent, parsed once per text in this process (configs are frozen)."""
    return build_config(tomllib.loads(text), "config sent by the ServerApp")


def state_key(algorithm: str, seed: int) -> str:
    """Name of one run's client state (several algorithms/seeds may share a node)."""
    return f"pflkit.{algorithm}.seed{seed}"


@dataclass
class NodeSetup:
    client_id: int
    data: FederatedData  # holds at least this node's client
    model: UnitModel
    init: dict[str, torch.Tensor]
    train: TrainSettings
    device: torch.device
    threads: int  # torch intra-op threads of this node's work

    @property
    def client(self) -> ClientData:
        return self.data.client(self.client_id)

    def algorithm(self, config: BaseConfig, name: str) -> Algorithm:
        algorithm = build_algorithm(name, config.algorithm_sections(), self.train, self.model.units())
        algorithm.check_model(self.model)
        return algorithm


def _own_data(folder: Path, client_id: int, num_classes: int, device: torch.device) -> FederatedData:
    """A node's own data: ``train.npz`` and ``test.npz``, each with arrays ``x`` and ``y``."""
    parts = []
    for split in ("train", "test"):
        path = folder / f"{split}.npz"
        if not path.is_file():
            raise DataError(f"client data folder {folder} lacks {split}.npz (arrays x and y)")
        try:
            with np.load(path) as f:
                x, y = torch.as_tensor(f["x"]), torch.as_tensor(f["y"], dtype=torch.long)
                x = x.long() if not x.is_floating_point() else x.float()  # token ids stay integers
        except (KeyError, ValueError, OSError) as exc:
            raise DataError(f"{path} is not an .npz file with arrays x and y: {exc}") from exc
        if len(x) != len(y):
            raise DataError(f"{path}: {len(x)} inputs but {len(y)} labels")
        parts += [x.to(device), y.to(device)]
    client = ClientData(client_id, *parts)
    return FederatedData.from_clients([client], num_classes, name=str(folder))


@functools.lru_cache(maxsize=8)
def _shared_partition(config_text: str, data_dir: str | None, seed: int, device: str) -> FederatedData:
    config = config_from_text(config_text)
    pseed = partition_seed(config, seed)
    if config.dataset in NATURAL_DATASETS:
        return apply_feature_shift(natural_clients(config, pseed, device, data_dir), config.feature_shift, pseed)
    return partition_dataset(config, load_pool(config, data_dir), pseed, device)


def node_setup(config_text: str, node_config: Mapping[str, Any], seed: int) -> NodeSetup:
    """Build (and cache in this process) what this node needs for one seed of the experiment, and
    give the calling thread the node's intra-op thread count (a message may run on another thread
    than the one that built the setup)."""
    setup = _node_setup(config_text, tuple(sorted(node_config.items())), seed)
    torch.set_num_threads(setup.threads)
    return setup


@functools.lru_cache(maxsize=8)
def _node_setup(config_text: str, node_items: tuple, seed: int) -> NodeSetup:
    node = dict(node_items)
    config = config_from_text(config_text)
    if "partition-id" not in node:
        raise ValueError("this SuperNode has no 'partition-id' in its node config (the pflkit client id)")
    client_id = int(node["partition-id"])
    clients = config.partition.num_clients
    if "num-partitions" in node and int(node["num-partitions"]) != clients:
        raise ValueError(
            f"node config num-partitions={node['num-partitions']} differs from the experiment's num_clients={clients}"
        )
    if not 0 <= client_id < clients:
        raise ValueError(f"partition-id {client_id} is outside 0..{clients - 1}")
    device = resolve_device(str(node.get("device", config.run.device)))
    threads = int(node.get("threads", config.run.threads))
    torch.set_num_threads(threads)
    if "client-data" in node:
        if config.dataset not in NUM_CLASSES:
            raise ValueError(
                f"client-data folders need a dataset with a known class count "
                f"({', '.join(NUM_CLASSES)}), not {config.dataset!r}"
            )
        data = _own_data(Path(str(node["client-data"])), client_id, NUM_CLASSES[config.dataset], device)
    else:
        data = _shared_partition(config_text, node.get("data-dir"), seed, str(device))
    model, init = initial_params(config, data, seed, device)
    return NodeSetup(client_id, data, model, init, config.train, device, threads)


@dataclass
class NodeRun:
    """One run (config, algorithm, seed) on this node: what each of its messages reuses (the
    algorithm is ``round_setup.algorithm``)."""

    setup: NodeSetup
    round_setup: RoundSetup


def node_run(config_text: str, node_config: Mapping[str, Any], name: str, seed: int) -> NodeRun:
    """Build (and cache in this process) one run's node setup and round setup (with its algorithm),
    and give the calling thread the node's intra-op thread count (see :func:`node_setup`)."""
    run = _node_run(config_text, tuple(sorted(node_config.items())), name, seed)
    torch.set_num_threads(run.setup.threads)
    return run


@functools.lru_cache(maxsize=8)
def _node_run(config_text: str, node_items: tuple, name: str, seed: int) -> NodeRun:
    config = config_from_text(config_text)
    setup = _node_setup(config_text, node_items, seed)
    algorithm = setup.algorithm(config, name)
    round_setup = RoundSetup(
        algorithm, setup.data, setup.model, setup.model.units(), setup.train, seed, local_model_metrics(config.metrics)
    )
    return NodeRun(setup, round_setup)


def state_file(node_config: Mapping[str, Any], key: str) -> Path | None:
    folder = node_config.get("state-dir")
    return Path(str(folder)) / f"{key}.pt" if folder else None


Versions = list[tuple[int, dict[str, Any]]]


def state_before(versions: Versions, round: int) -> dict[str, Any] | None:
    """The client's state as it stood before training round ``round``: its newest saved state
    from an earlier round (a ServerApp restarted from its checkpoint may re-send a round that this
    client already trained; the client then starts it again from the same state)."""
    return next((state for r, state in versions if r < round), None)


def add_version(versions: Versions, round: int, state: dict[str, Any]) -> Versions:
    """Keep the state after ``round`` and the newest one before it (newest first)."""
    older = [(r, s) for r, s in versions if r < round][:1]
    return [(round, state)] + older


def versions_to_record(versions: Versions) -> dict[str, Any]:
    return {"versions": [{"round": r, "state": s} for r, s in versions]}


def versions_from_record(record: Mapping[str, Any]) -> Versions:
    return [(int(v["round"]), v["state"]) for v in record["versions"]]


def save_state(path: Path, versions: Versions) -> None:
    """Atomically write a client's saved states (a restarted SuperNode reads them back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"round": versions[0][0], **versions_to_record(versions)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_state(path: Path, device: torch.device) -> Versions:
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
        return [(r, to_device(state, device)) for r, state in versions_from_record(raw)]
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise RuntimeError(
            f"client state file {path} is unreadable ({exc}); delete it to restart this client from the initial model"
        ) from exc

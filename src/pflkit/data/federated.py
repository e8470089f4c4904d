"""Federated views of a dataset: clients as index arrays, their tensors resident on one device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .dataset import Dataset
from .errors import DataError, PartitionError
from .partition import PartitionSpec, class_counts, split_clients, stratified_test_split


def official_split(data: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, test rows) of the dataset's official split; datasets without one (digits,
    synthetic) use a fixed stratified 75/25 split of their own."""
    n = len(data)
    if data.official_train is not None:
        if not 0 < data.official_train < n:
            raise DataError(
                f"dataset {data.name!r} holds {data.official_train} official training and "
                f'{n - data.official_train} official test samples: test_set = "official" needs both'
            )
        return np.arange(data.official_train), np.arange(data.official_train, n)
    return stratified_test_split(data.y.numpy())


@dataclass
class ClientData:
    """One client's training and test tensors (rows of the dataset, already on the device)."""

    client_id: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    train_rows: torch.Tensor | None = None  # rows of FederatedData.x (batched engines gather from it)
    test_rows: torch.Tensor | None = None

    @property
    def num_train(self) -> int:
        return int(len(self.train_y))

    @property
    def num_test(self) -> int:
        return int(len(self.test_y))


@dataclass
class FederatedData:
    """A partitioned dataset: per-client train/test index arrays and tensors."""

    dataset: str
    num_classes: int
    input_shape: tuple[int, ...]
    train_indices: list[np.ndarray]
    test_indices: list[np.ndarray]
    clients: list[ClientData]
    counts: np.ndarray  # [num_clients, num_classes], all samples of each client
    x: torch.Tensor | None = None  # the whole dataset on the device (batched engines gather from it)
    y: torch.Tensor | None = None
    vocab_size: int | None = None  # token-id data: ids are in 0..vocab_size-1 (the embedding size)
    partition_info: dict[str, Any] = field(default_factory=dict)  # how the split was drawn (split_clients)
    global_test_rows: torch.Tensor | None = None  # rows of x, y: the global test set (official protocol)

    @property
    def global_test(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The global test set (the official test split), or None under the client-split protocol."""
        if self.global_test_rows is None or self.x is None or self.y is None:
            return None
        return self.x[self.global_test_rows], self.y[self.global_test_rows]

    def prior(self, client_id: int) -> np.ndarray:
        """The client's training label distribution pi (sums to 1)."""
        counts = self.train_label_counts(client_id).astype(np.float64)
        return counts / max(counts.sum(), 1.0)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def client(self, client_id: int) -> ClientData:
        """The client with this id (a node on Flower may hold only its own client)."""
        if client_id < len(self.clients) and self.clients[client_id].client_id == client_id:
            return self.clients[client_id]
        for c in self.clients:
            if c.client_id == client_id:
                return c
        raise KeyError(f"no client {client_id} in this data")

    def train_label_counts(self, client_id: int) -> np.ndarray:
        y = self.client(client_id).train_y.cpu().numpy()
        return np.bincount(y, minlength=self.num_classes)

    @classmethod
    def build(
        cls, data: Dataset, spec: PartitionSpec, seed: int, *, batch_size: int = 10, device: torch.device | str = "cpu"
    ) -> FederatedData:
        """Partition ``data`` over clients by ``spec`` with partition seed ``seed``, split each
        client into training and test data, move tensors to ``device``;
        ``batch_size`` (the run's training batch) sizes PFLlib's default minimum client size.

        Problems name the dataset and its size next to the config keys to change.
        """
        labels = data.y.numpy()
        pools = official_split(data) if spec.official else None
        try:
            split = split_clients(labels, spec, seed, pools, batch_size=batch_size)
        except PartitionError as exc:
            raise PartitionError(
                f"dataset {data.name!r} ({len(labels)} samples, {data.num_classes} classes): {exc}"
            ) from None
        x, y = data.x.to(device), data.y.to(device)
        if pools is not None and data.official_train is None:
            split.info["official_split"] = "none shipped: a fixed stratified 75/25 split (seed 0) of the dataset"
        clients = []
        for i, (tr, te) in enumerate(zip(split.train, split.test)):
            tr_t = torch.as_tensor(tr, device=device)
            te_t = torch.as_tensor(te, device=device)
            clients.append(ClientData(i, x[tr_t], y[tr_t], x[te_t], y[te_t], tr_t, te_t))
        parts = [np.concatenate([tr, te]) for tr, te in zip(split.train, split.test)]
        return cls(
            dataset=data.name,
            num_classes=data.num_classes,
            input_shape=tuple(data.input_shape),
            train_indices=split.train,
            test_indices=split.test,
            clients=clients,
            counts=class_counts(labels, parts, data.num_classes),
            x=x,
            y=y,
            vocab_size=data.vocab_size,
            partition_info=split.info,
            global_test_rows=None if pools is None else torch.as_tensor(pools[1], device=device),
        )

    def partition_record(self) -> dict[str, Any]:
        """What a results folder keeps of the partition: how it was drawn and, per client, the
        class counts of its training and test samples."""

        def counts(labels: torch.Tensor) -> list[int]:
            return np.bincount(labels.cpu().numpy(), minlength=self.num_classes).tolist()

        return {
            "dataset": self.dataset,
            "num_clients": self.num_clients,
            "num_classes": self.num_classes,
            **self.partition_info,
            "train_class_counts": [counts(c.train_y) for c in self.clients],
            "test_class_counts": [counts(c.test_y) for c in self.clients],
        }

    @classmethod
    def from_clients(
        cls, clients: list[ClientData], num_classes: int, name: str = "custom", vocab_size: int | None = None
    ) -> FederatedData:
        """Wrap ready-made client tensors (tests, custom pipelines) into a FederatedData."""
        xs = [t for c in clients for t in (c.train_x, c.test_x)]
        ys = [t for c in clients for t in (c.train_y, c.test_y)]
        x, y = torch.cat(xs), torch.cat(ys)
        out, rows, offset = [], [], 0
        for c in clients:
            tr = torch.arange(offset, offset + c.num_train, device=x.device)
            te = torch.arange(offset + c.num_train, offset + c.num_train + c.num_test, device=x.device)
            offset += c.num_train + c.num_test
            out.append(ClientData(c.client_id, c.train_x, c.train_y, c.test_x, c.test_y, tr, te))
            rows.append((tr, te))
        counts = np.stack(
            [np.bincount(torch.cat([c.train_y, c.test_y]).cpu().numpy(), minlength=num_classes) for c in clients]
        )
        return cls(
            dataset=name,
            num_classes=num_classes,
            input_shape=tuple(x.shape[1:]),
            train_indices=[tr.cpu().numpy() for tr, _ in rows],
            test_indices=[te.cpu().numpy() for _, te in rows],
            clients=out,
            counts=counts,
            x=x,
            y=y,
            vocab_size=vocab_size,
        )

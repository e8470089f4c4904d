"""Federated views of a dataset: clients as index arrays, their tensors resident on one device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .partition import class_counts, partition, split_train_test
from .sources import Dataset


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
    def build(cls, data: Dataset, *, num_clients: int, method: str, rng: np.random.Generator,
              alpha: float = 0.1, classes_per_client: int = 2, balanced: bool = False,
              min_samples: int | None = None, train_fraction: float = 0.75,
              device: torch.device | str = "cpu") -> "FederatedData":
        """Partition ``data`` over clients, split each 75/25 (spec §5.5), move tensors to ``device``."""
        labels = data.y.numpy()
        parts = partition(labels, method=method, num_clients=num_clients, rng=rng, alpha=alpha,
                          classes_per_client=classes_per_client, balanced=balanced,
                          min_samples=min_samples)
        train_idx, test_idx = split_train_test(parts, train_fraction, rng)
        x, y = data.x.to(device), data.y.to(device)
        clients = []
        for i, (tr, te) in enumerate(zip(train_idx, test_idx)):
            tr_t = torch.as_tensor(tr, device=device)
            te_t = torch.as_tensor(te, device=device)
            clients.append(ClientData(i, x[tr_t], y[tr_t], x[te_t], y[te_t], tr_t, te_t))
        return cls(dataset=data.name, num_classes=data.num_classes, input_shape=tuple(data.input_shape),
                   train_indices=train_idx, test_indices=test_idx, clients=clients,
                   counts=class_counts(labels, parts, data.num_classes), x=x, y=y, vocab_size=data.vocab_size)

    @classmethod
    def from_clients(cls, clients: list[ClientData], num_classes: int, name: str = "custom",
                     vocab_size: int | None = None) -> "FederatedData":
        """Wrap ready-made client tensors (tests, custom pipelines) into a FederatedData."""
        xs = [t for c in clients for t in (c.train_x, c.test_x)]
        ys = [t for c in clients for t in (c.train_y, c.test_y)]
        x, y = torch.cat(xs), torch.cat(ys)
        out, offset = [], 0
        for c in clients:
            tr = torch.arange(offset, offset + c.num_train, device=x.device)
            te = torch.arange(offset + c.num_train, offset + c.num_train + c.num_test, device=x.device)
            offset += c.num_train + c.num_test
            out.append(ClientData(c.client_id, c.train_x, c.train_y, c.test_x, c.test_y, tr, te))
        counts = np.stack([np.bincount(torch.cat([c.train_y, c.test_y]).cpu().numpy(), minlength=num_classes)
                           for c in clients])
        return cls(dataset=name, num_classes=num_classes, input_shape=tuple(x.shape[1:]),
                   train_indices=[c.train_rows.cpu().numpy() for c in out],
                   test_indices=[c.test_rows.cpu().numpy() for c in out], clients=out, counts=counts, x=x, y=y,
                   vocab_size=vocab_size)

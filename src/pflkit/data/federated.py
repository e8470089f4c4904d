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

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def train_label_counts(self, client_id: int) -> np.ndarray:
        y = self.clients[client_id].train_y.cpu().numpy()
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
            clients.append(ClientData(i, x[tr_t], y[tr_t], x[te_t], y[te_t]))
        return cls(dataset=data.name, num_classes=data.num_classes, input_shape=tuple(data.input_shape),
                   train_indices=train_idx, test_indices=test_idx, clients=clients,
                   counts=class_counts(labels, parts, data.num_classes))

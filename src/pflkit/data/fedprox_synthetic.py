"""FedProx's Synthetic(alpha, beta) data (Li et al. 2020, after Shamir et al. 2014), generated offline
and seeded; LEAF ships the same generator.

Per client k (generate_synthetic.py of the FedProx repository, transcribed):

* n_k = floor(LogNormal(4, 2)) + 50 samples;
* u_k ~ N(0, alpha), B_k ~ N(0, beta); W_k ~ N(u_k, 1) of shape [60, 10], b_k ~ N(u_k, 1) of shape [10];
* v_k ~ N(B_k, 1) in 60 dimensions; x ~ N(v_k, Sigma) with Sigma diagonal, Sigma_jj = j^-1.2;
* y = argmax softmax(x W_k + b_k).

As in that code, u_k shifts all ten columns of W_k and b_k alike, which leaves the argmax unchanged:
each client's labelling model differs from the others' by its own draw of W_k and b_k at any alpha.
``iid=True`` is its Synthetic-IID: one W ~ N(0, 1) and b ~ N(0, 1) for all, v_k = 0. Each client's
samples are shuffled and split 90/10 into train and test (``int(0.9 n_k)`` training samples).
"""

from __future__ import annotations

import numpy as np
import torch

from pflkit.data.federated import ClientData, FederatedData

__all__ = ["DIMENSION", "NUM_CLASSES", "fedprox_synthetic", "generate_synthetic", "synthetic_sizes"]

DIMENSION = 60
NUM_CLASSES = 10
TRAIN_SHARE = 0.9


def synthetic_sizes(num_clients: int, rng: np.random.Generator) -> np.ndarray:
    """Per-client sample counts: ``floor(LogNormal(mean 4, sigma 2)) + 50``."""
    return rng.lognormal(4, 2, num_clients).astype(np.int64) + 50


def generate_synthetic(
    num_clients: int, alpha: float, beta: float, *, iid: bool = False, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per client, (x float32 [n_k, 60], y int64 [n_k]) of Synthetic(alpha, beta), in generation order."""
    if num_clients < 1:
        raise ValueError(f"Synthetic(alpha, beta) needs at least one client, got {num_clients}")
    if alpha < 0 or beta < 0:
        raise ValueError(f"Synthetic(alpha, beta) needs alpha, beta >= 0, got alpha={alpha}, beta={beta}")
    rng = np.random.default_rng(seed)
    sizes = synthetic_sizes(num_clients, rng)
    scale = np.power(np.arange(1, DIMENSION + 1, dtype=np.float64), -1.2) ** 0.5  # sqrt of Sigma's diagonal
    if iid:
        shared_w = rng.normal(0, 1, (DIMENSION, NUM_CLASSES))
        shared_b = rng.normal(0, 1, NUM_CLASSES)
        means = np.zeros((num_clients, DIMENSION))
    else:
        mean_w = rng.normal(0, alpha, num_clients)
        shifts = rng.normal(0, beta, num_clients)
        means = np.stack([rng.normal(shift, 1, DIMENSION) for shift in shifts])
    out = []
    for k in range(num_clients):
        if iid:
            w, b = shared_w, shared_b
        else:
            w = rng.normal(mean_w[k], 1, (DIMENSION, NUM_CLASSES))
            b = rng.normal(mean_w[k], 1, NUM_CLASSES)
        x = means[k] + rng.standard_normal((int(sizes[k]), DIMENSION)) * scale
        y = np.argmax(x @ w + b, axis=1)  # softmax is monotone: its argmax is the logits'
        out.append((x.astype(np.float32), y.astype(np.int64)))
    return out


def fedprox_synthetic(
    num_clients: int,
    alpha: float,
    beta: float,
    *,
    iid: bool = False,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> FederatedData:
    """Synthetic(alpha, beta) as a FederatedData: each client's samples shuffled and split 90/10."""
    rng = np.random.default_rng([seed, 1])  # the shuffles: a stream apart from the data's
    clients = []
    for k, (x, y) in enumerate(generate_synthetic(num_clients, alpha, beta, iid=iid, seed=seed)):
        order = rng.permutation(len(y))
        cut = int(TRAIN_SHARE * len(y))
        tr, te = order[:cut], order[cut:]
        parts = [torch.from_numpy(a).to(device) for a in (x[tr], y[tr], x[te], y[te])]
        clients.append(ClientData(k, *parts))
    return FederatedData.from_clients(clients, NUM_CLASSES, name="fedprox_synthetic")

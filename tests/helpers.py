"""Small builders shared by the tests."""

from __future__ import annotations

import torch

from pflkit.algorithms import ClientContext, TrainSettings
from pflkit.data.federated import ClientData
from pflkit.models import build_model


def tiny_context(n_train: int = 30, seed: int = 0, round: int = 1, batch_size: int = 10,
                 lr: float = 0.1) -> ClientContext:
    """A client with ``n_train`` random 8x8 samples and the digits CNN."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_model("digits_cnn", (1, 8, 8), 10)
    x = torch.randn(n_train + 8, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n_train + 8,), generator=g)
    data = ClientData(0, x[:n_train], y[:n_train], x[n_train:], y[n_train:])
    return ClientContext(client_id=0, round=round, seed=seed, data=data, model=model, units=model.units(),
                         train=TrainSettings(batch_size=batch_size, local_epochs=1, lr=lr), algorithm="test")


def params_of(ctx: ClientContext, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    fresh = build_model("digits_cnn", (1, 8, 8), 10)
    return {k: v.detach().clone() for k, v in fresh.named_parameters()}


def assert_states_close(a, b, atol: float) -> None:
    """Server and client states equal within ``atol`` (0: bit-identical)."""
    def walk(x, y, path):
        if isinstance(x, dict):
            assert x.keys() == y.keys(), path
            for k in x:
                walk(x[k], y[k], f"{path}.{k}")
        elif isinstance(x, torch.Tensor):
            if atol == 0:
                assert torch.equal(x, y), path
            else:
                torch.testing.assert_close(x, y, rtol=1e-3, atol=atol, msg=path)
        else:
            assert x == y, path
    walk(a.server, b.server, "server")
    walk(a.clients, b.clients, "clients")

"""Small builders shared by the tests."""

from __future__ import annotations

import torch

from pflkit.algorithms import TrainSettings
from pflkit.data.federated import ClientData
from pflkit.engines import SingleClientContext
from pflkit.models import build_model


def tiny_context(n_train: int = 30, seed: int = 0, round: int = 1, batch_size: int = 10,
                 lr: float = 0.1) -> SingleClientContext:
    """A client with ``n_train`` random 8x8 samples and the digits CNN."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_model("digits_cnn", (1, 8, 8), 10)
    x = torch.randn(n_train + 8, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n_train + 8,), generator=g)
    data = ClientData(0, x[:n_train], y[:n_train], x[n_train:], y[n_train:])
    return SingleClientContext(client_id=0, round=round, seed=seed, data=data, model=model, units=model.units(),
                               train=TrainSettings(batch_size=batch_size, local_epochs=1, lr=lr, rounds=1),
                               algorithm="test")


def params_of(ctx: SingleClientContext, seed: int) -> dict[str, torch.Tensor]:
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


def batch_pairs(ctx: SingleClientContext, purpose: str = "train", epochs: int = 1) -> list[tuple]:
    """The context's mini-batches of ``purpose`` as (x, y) pairs."""
    from pflkit.algorithms import TrainBatches

    return [(b.x, b.y) for b in ctx.batches(TrainBatches(purpose, epochs))]


def sgd_reference(ctx: SingleClientContext, params: dict, purpose: str = "train", epochs: int = 1,
                  lr: float | None = None, prox_anchor: dict | None = None, prox_mu: float = 0.0) -> dict:
    """Plain SGD on cross-entropy (+ mu/2 ||w - anchor||^2) over the context's batches, written
    out step by step: the reference the library's training is checked against."""
    from pflkit.functional import forward

    lr = ctx.train.lr if lr is None else lr
    w = {k: v.detach().clone() for k, v in params.items()}
    for x, y in batch_pairs(ctx, purpose, epochs):
        leaves = {k: v.requires_grad_(True) for k, v in w.items()}
        loss = torch.nn.functional.cross_entropy(forward(ctx.model, leaves, x, train=True), y)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        with torch.no_grad():
            w = {k: (v - lr * (g + (prox_mu * (v - prox_anchor[k]) if prox_anchor is not None else 0))).detach()
                 for (k, v), g in zip(leaves.items(), grads)}
    return w


def simulate_rounds(setup, engine, init: dict, rounds: int, join_ratio: float = 1.0, eval_every: int = 1):
    """``rounds`` rounds (and the final evaluation) of ``setup`` on ``engine`` from ``init``."""
    from pflkit.algorithms import ClientSummary
    from pflkit.federation import RoundDriver, RunSession

    data = setup.data
    driver = RoundDriver(setup.algorithm, num_clients=data.num_clients, seed=setup.seed, rounds=rounds,
                         join_ratio=join_ratio, eval_every=eval_every)
    summaries = [ClientSummary(i, data.client(i).num_train, data.train_label_counts(i))
                 for i in range(data.num_clients)]
    return RunSession.open(driver, init, summaries).run(lambda jobs, round: engine.run(setup, jobs, round))


def fit_on(model, params: dict, batches: list[tuple], lr: float, trainable=None):
    """``ctx.fit`` of cross-entropy over exactly ``batches`` (in order, equal sizes) of one client."""
    from pflkit.algorithms import Sample, SampleBatches, TrainSettings
    from pflkit.functional import classification_loss

    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    data = ClientData(0, x, y, x[:1], y[:1])
    ctx = SingleClientContext(0, 1, 0, data, model, model.units(),
                              TrainSettings(batch_size=len(batches[0][1]), lr=lr), "test")
    fit = ctx.fit(params, classification_loss, trainable=trainable, data=SampleBatches(Sample(x, y)))
    return fit.params, fit.loss


def flat_form(table: dict) -> dict:
    """A sectioned config table in the flat spelling an older pflkit wrote (keys without a flat
    alias, such as partition.max_retries, are left out, as those files never had them)."""
    from pflkit.config import FLAT_KEYS, SECTIONS

    alias = {target: key for key, target in FLAT_KEYS.items()}
    out = {k: v for k, v in table.items() if k not in SECTIONS}
    for section in SECTIONS:
        out.update({alias[(section, f)]: v for f, v in table[section].items() if (section, f) in alias})
    return out

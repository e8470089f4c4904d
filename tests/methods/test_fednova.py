"""FedNova: the normaliser and the server's average against a computation by hand
(docs/reference/methods/fednova.md), and against my transcription of the authors' code: JYWa/FedNova
47b4e09, ``distoptim/FedNova.py`` (``FedNova.step``, ``FedNova.average``), ``train_LocalSGD.py``
(plain PyTorch written from reading it, never copied, fed with the client's own mini-batches)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms.fednova import normaliser
from tests.support.builders import batch_pairs, build, params_of, seeded_client, tiny_context
from tests.support.checks import assert_expected_close
from tests.support.references import module_at, sgd_reference, weights


def test_fednova_normalises_by_steps_and_momentum_and_averages_the_directions():
    assert float(normaliser(4, 0.0)) == 4
    assert float(normaliser(3, 0.5)) == pytest.approx(1 + 1.5 + 1.75)
    ctx = tiny_context(n_train=30)
    glob = params_of(ctx, 2)
    alg = build("fednova", ctx)
    state, _ = alg.local_init({"global": glob}, alg.init_client(glob, 0), ctx)
    new, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    trained = sgd_reference(ctx, glob, "train", 1)
    assert metrics["local_steps"] == 3
    for k in glob:
        torch.testing.assert_close(upload["params"][k], (glob[k] - trained[k]) / 3)
    d1 = {k: torch.ones_like(v) for k, v in glob.items()}
    d2 = {k: 3 * torch.ones_like(v) for k, v in glob.items()}
    ups = [
        {"params": d1, "num_samples": 10, "normaliser": torch.tensor(2.0), "client_id": 0},
        {"params": d2, "num_samples": 30, "normaliser": torch.tensor(6.0), "client_id": 1},
    ]
    merged = alg.aggregate({"global": glob}, ups, 1)["global"]
    tau_eff = 0.25 * 2 + 0.75 * 6
    for k in glob:
        torch.testing.assert_close(merged[k], glob[k] - tau_eff * (0.25 * 1 + 0.75 * 3))


# ============================================================================ the authors' code


class FedNovaReferenceOptimizer:
    """My transcription of JYWa/FedNova distoptim/FedNova.py (47b4e09), FedNova.step with mu = 0 and
    no Nesterov: the gradient gets weight_decay * p; with momentum the buffer is the gradient at the
    first step and m * buf + (1 - dampening) * d afterwards (dampening 0); the client keeps
    cum = sum lr * d and steps p -= lr * d; the normalising scalar a gains counter <- counter * m + 1
    per step (with momentum) or 1 per step (without)."""

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float, weight_decay: float) -> None:
        self.params, self.lr, self.m, self.wd = params, lr, momentum, weight_decay
        self.buf: list[torch.Tensor | None] = [None] * len(params)
        self.cum: list[torch.Tensor | None] = [None] * len(params)
        self.counter, self.a = 0.0, 0.0

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            d = p.grad.clone()
            if self.wd:
                d += self.wd * p
            if self.m:
                self.buf[i] = d.clone() if self.buf[i] is None else self.buf[i] * self.m + d
                d = self.buf[i]
            self.cum[i] = self.lr * d if self.cum[i] is None else self.cum[i] + self.lr * d
            p -= self.lr * d
        if self.m:
            self.counter = self.counter * self.m + 1
            self.a += self.counter
        else:
            self.a += 1


def fednova_reference_client(ctx, glob: dict, epochs: int) -> tuple[dict, float, dict]:
    """train_LocalSGD.py's train(): CE per batch, backward, FedNova step, for the round's epochs."""
    model = module_at(ctx.model, glob)
    names = [k for k, _ in model.named_parameters()]
    opt = FedNovaReferenceOptimizer(list(model.parameters()), ctx.train.lr, ctx.train.momentum, ctx.train.weight_decay)
    for x, y in batch_pairs(ctx, "train", epochs):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return weights(model), opt.a, dict(zip(names, opt.cum))


def fednova_reference_server(old: dict, clients: list[tuple[float, float, dict]]) -> dict:
    """FedNova.average with gmf = 0: tau_eff = sum_i ratio_i a_i (all-reduced); each client scales its
    cum by ratio_i * tau_eff / a_i; the sum is subtracted from the round's starting point."""
    tau_eff = sum(ratio * a for ratio, a, _ in clients)
    return {k: old[k] - sum(ratio * (tau_eff / a) * cum[k] for ratio, a, cum in clients) for k in old}


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fednova_matches_the_authors_optimizer_and_average(momentum):
    # the authors' script hard-codes weight_decay=1e-4 (train_LocalSGD.py); two clients with 6 and 10 steps
    settings = {"lr": 0.05, "momentum": momentum, "weight_decay": 1e-4, "epochs": 2}
    ctxs = [seeded_client(30, seed=0, client_id=0, **settings), seeded_client(50, seed=1, client_id=1, **settings)]
    glob = params_of(ctxs[0], 2)
    alg = build("fednova", ctxs[0])
    uploads, reference = [], []
    total = sum(c.num_train for c in ctxs)
    for ctx in ctxs:
        stale = alg.init_client(params_of(ctx, 7), ctx.client_id)
        state, _ = alg.local_init({"global": glob}, stale, ctx)
        new, upload, _ = alg.local_train({"global": glob}, state, ctx)
        uploads.append({**upload, "client_id": ctx.client_id})
        trained, a, cum = fednova_reference_client(ctx, glob, 2)
        assert_expected_close(new["model"], trained)
        assert float(upload["normaliser"]) == pytest.approx(a, rel=1e-9)
        reference.append((ctx.num_train / total, a, cum))
    if not momentum:
        assert [float(u["normaliser"]) for u in uploads] == [6.0, 10.0]
    merged = alg.aggregate({"global": glob}, uploads, 1)["global"]
    assert_expected_close(merged, fednova_reference_server(glob, reference))

"""Transcriptions of reference code that several method files compare pflkit with.

Each is plain PyTorch written from reading the reference named in its docstring (never copied),
following its structure: its optimiser, step order, batch use, loss terms and server rule. The
transcriptions that one method's tests alone use live beside them in tests/methods/test_<method>.py.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from tests.support.builders import batch_pairs

# a remaining difference from the reference: the comparison must fail, by its assertion
XFAIL_DIFFERS = functools.partial(pytest.mark.xfail, strict=True, raises=AssertionError)
BODY = 3  # digits_cnn: conv1, conv2, fc1 are the body; unit 3 (fc) is the linear head


# ---- nn.Module copies of a client's model ------------------------------------------------------
def module_at(model: nn.Module, params: dict) -> nn.Module:
    """A private nn.Module copy of ``model`` holding ``params`` (what the references' clients own)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for k, p in m.named_parameters():
            p.copy_(params[k])
    return m


def weights(m: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters, detached copies."""
    return {k: v.detach().clone() for k, v in m.named_parameters()}


def flat(m: nn.Module) -> torch.Tensor:
    """All of the module's parameters in one vector."""
    return torch.cat([p.reshape(-1) for p in m.parameters()])


# ---- by hand: losses, gradients and plain SGD steps on parameter dicts ----------------------------
def sq(a, b) -> float:
    """The squared distance between two parameter dicts."""
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a))


def ce_grads(ctx, params, x, y):
    """The gradients of cross-entropy at ``params`` on (x, y), through pflkit's ``forward``."""
    from pflkit.functional import forward

    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = F.cross_entropy(forward(ctx.model, leaves, x), y)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def ce(model, params, x, y):
    """Cross-entropy of ``model`` run with ``params`` (torch.func.functional_call)."""
    return F.cross_entropy(functional_call(model, params, (x,)), y)


def grads(model, params, x, y, loss_fn=None):
    """The gradients of ``loss_fn`` (default ``ce``) at ``params``."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = (loss_fn or ce)(model, leaves, x, y)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def step(params, g, lr):
    """One plain SGD step."""
    return {k: params[k] - lr * g[k] for k in params}


def sgd_reference(
    ctx,
    params: dict,
    purpose: str = "train",
    epochs: int = 1,
    lr: float | None = None,
    prox_anchor: dict | None = None,
    prox_mu: float = 0.0,
) -> dict:
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
            w = {
                k: (v - lr * (g + (prox_mu * (v - prox_anchor[k]) if prox_anchor is not None else 0))).detach()
                for (k, v), g in zip(leaves.items(), grads)
            }
    return w


# ---- PFLlib f1e313a (TsingZ0/PFLlib): the client and server base ------------------------------
def network(ctx, params: dict) -> torch.nn.Module:
    """A fresh nn.Module of the client's architecture holding ``params`` (PFLlib's ``set_parameters``
    copies the received tensors into the client's module)."""
    net = copy.deepcopy(ctx.model)
    net.load_state_dict({k: v.detach().clone() for k, v in params.items()}, strict=True)
    net.train()
    return net


def pfllib_sgd_epochs(net: torch.nn.Module, batches, lr: float, params=None) -> None:
    """clientavg.py ``train``: per batch zero_grad, CrossEntropyLoss, backward, torch.optim.SGD(lr).step
    (an optimiser over ``params``: all of the model by default)."""
    opt = torch.optim.SGD(net.parameters() if params is None else params, lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()


def pfllib_server_average(models: list[dict], train_samples: list[int]) -> dict:
    """serverbase.py ``receive_models`` + ``aggregate_parameters``: weights n_i / sum_j n_j over the
    selected clients; start from zeros and add each client's tensor times its weight."""
    total = sum(train_samples)
    out = {k: torch.zeros_like(v) for k, v in models[0].items()}
    for model, n in zip(models, train_samples):
        for k in out:
            out[k] += model[k].clone() * (n / total)
    return out


def pfllib_perturbed_epochs(net: torch.nn.Module, anchor: dict, batches, lr: float, mu: float) -> None:
    """fedoptimizer.py ``PerturbedGradientDescent.step`` after CE backward: every parameter moves by
    -lr * (its gradient + mu * (itself - the anchor tensor))."""
    for x, y in batches:
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for k, p in net.named_parameters():
                p.add_(p.grad + mu * (p - anchor[k]), alpha=-lr)


def pfllib_fedavg_client(ctx, glob: dict, lr: float) -> dict:
    """clientavg.py: the received global, E epochs of plain SGD."""
    net = network(ctx, glob)
    pfllib_sgd_epochs(net, batch_pairs(ctx, "train", ctx.train.local_epochs), lr)
    return weights(net)


# ---- SosicFL: floco (dennis-grinwald/floco a25b3a1) --------------------------------------------
class FlocoSimplexHead(nn.Module):
    """My transcription of floco's SimplexLinear (a25b3a1): an nn.Linear whose weight is
    sum_m alpha_m W_m over a ParameterList of endpoints, one shared bias; ``alphas`` is set before
    every forward (SimplexModel.forward: a fresh draw per training forward)."""

    def __init__(self, endpoints: list[torch.Tensor], bias: torch.Tensor) -> None:
        super().__init__()
        self._weights = nn.ParameterList([nn.Parameter(w.clone()) for w in endpoints])
        self.bias = nn.Parameter(bias.clone())
        self.alphas: list[float] = [1.0 / len(endpoints)] * len(endpoints)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = sum(a * w for a, w in zip(self.alphas, self._weights))
        return F.linear(h, weight, self.bias)


class FlocoModel(nn.Module):
    def __init__(self, ctx, endpoints: dict, m1: int) -> None:
        super().__init__()
        self.base = module_at(ctx.model, {**endpoints, "fc.weight": endpoints["fc.weight@0"]})
        self.classifier = FlocoSimplexHead([endpoints[f"fc.weight@{m}"] for m in range(m1)], endpoints["fc.bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.base(x, stop=BODY))

    def as_dict(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach().clone() for k, v in self.base.named_parameters() if not k.startswith("fc.")}
        out["fc.bias"] = self.classifier.bias.detach().clone()
        out.update({f"fc.weight@{m}": w.detach().clone() for m, w in enumerate(self.classifier._weights)})
        return out


def floco_training_loop(
    model: FlocoModel, batches, alphas: torch.Tensor, opt, anchor: dict | None = None, lamda: float = 1.0
) -> None:
    """floco's training_loop: per batch a fresh alpha (here the client's draws in order, cycling),
    CE, backward; Floco+ (``anchor``) adds lamda * p - anchor to every gradient
    (_regularize_pers_model, as its operator precedence reads), then the optimiser steps."""
    for step, (x, y) in enumerate(batches):
        model.classifier.alphas = [float(a) for a in alphas[step % len(alphas)]]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if anchor is not None:
            with torch.no_grad():
                for name, p in floco_named_parameters(model):
                    if p.grad is not None:
                        p.grad += lamda * p - anchor[name]
        opt.step()


def floco_named_parameters(model: FlocoModel):
    for k, p in model.base.named_parameters():
        if not k.startswith("fc."):
            yield k, p
    yield "fc.bias", model.classifier.bias
    for m, w in enumerate(model.classifier._weights):
        yield f"fc.weight@{m}", w


def floco_optimizer(model: FlocoModel, ctx) -> torch.optim.SGD:
    return torch.optim.SGD(
        [p for _, p in floco_named_parameters(model)],
        lr=ctx.train.lr,
        momentum=ctx.train.momentum,
        weight_decay=ctx.train.weight_decay,
    )


# ---- Flower's server strategies and Reddi et al.'s Algorithm 2 ----------------------------------------------
def flower_average(replies: list[tuple[dict, int]]) -> dict[str, np.ndarray]:
    """strategy_utils.aggregate_arrayrecords (flwr 1.41): each reply's arrays times n_i / sum n, summed
    in reply order, in NumPy."""
    total = sum(n for _, n in replies)
    out: dict[str, np.ndarray] = {}
    for arrays, n in replies:
        for k, x in arrays.items():
            out[k] = x.numpy() * (n / total) if k not in out else out[k] + x.numpy() * (n / total)
    return out


class FlowerFedAvgM:
    """My transcription of flwr 1.41 serverapp/strategy/fedavgm.py (``aggregate_train``): the FedAvg
    average, the pseudo-gradient old − new, the momentum vector set to it in the first round and
    momentum * vector + gradient afterwards, then old − server_learning_rate * vector; the server
    optimiser runs only when the momentum is not 0 or the rate not 1."""

    def __init__(self, initial: dict, server_learning_rate: float = 1.0, server_momentum: float = 0.0) -> None:
        self.current = {k: v.numpy().copy() for k, v in initial.items()}
        self.lr, self.momentum = server_learning_rate, server_momentum
        self.vector: dict[str, np.ndarray] | None = None

    def configure_train(self, arrays: dict) -> None:
        """FedAvgM keeps the arrays it is given only in the first round: its own result afterwards."""

    def round(self, server_round: int, replies: list[tuple[dict, int]]) -> dict[str, torch.Tensor]:
        new = flower_average(replies)
        if self.momentum != 0.0 or self.lr != 1.0:
            gradient = {k: self.current[k] - new[k] for k in new}
            if self.momentum > 0.0:
                if self.vector is None:
                    self.vector = gradient
                else:
                    self.vector = {k: self.momentum * self.vector[k] + gradient[k] for k in gradient}
                gradient = self.vector
            new = {k: self.current[k] - self.lr * gradient[k] for k in gradient}
        self.current = new
        return {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in new.items()}


class FlowerFedOpt:
    """My transcription of flwr 1.41 serverapp/strategy/fedopt.py (``_compute_deltat_and_mt``) and the
    ``aggregate_train`` of fedadagrad.py, fedadam.py and fedyogi.py (``kind``): delta = average −
    current arrays; m_t and v_t start at zeros; m_t = beta_1 m_t + (1 − beta_1) delta (FedAdagrad
    passes beta_1 = 0); v_t: Adagrad v + delta², Adam beta_2 v + (1 − beta_2) delta², Yogi
    v − (1 − beta_2) delta² sign(v − delta²); new = current + eta m_t / (sqrt(v_t) + tau), where Adam's
    eta is eta sqrt(1 − beta_2^(round + 1)) / (1 − beta_1^(round + 1)). ``configure_train`` takes
    the arrays the round sends (pflkit's global model, which Flower's own run would have computed):
    each round is one of Flower's steps from pflkit's model, with Flower's m_t and v_t carried over,
    so that float rounding is not amplified across rounds where v_t is tiny."""

    def __init__(self, kind: str, initial: dict, eta: float, beta_1: float, beta_2: float, tau: float) -> None:
        assert kind in ("adagrad", "adam", "yogi")
        self.kind, self.eta, self.tau = kind, eta, tau
        self.beta_1, self.beta_2 = (0.0, 0.0) if kind == "adagrad" else (beta_1, beta_2)
        self.current = {k: v.numpy().copy() for k, v in initial.items()}
        self.m_t: dict[str, np.ndarray] | None = None
        self.v_t: dict[str, np.ndarray] | None = None

    def configure_train(self, arrays: dict) -> None:
        """FedOpt's ``configure_train``: the current arrays are those sent for this round's training."""
        self.current = {k: v.numpy().copy() for k, v in arrays.items()}

    def round(self, server_round: int, replies: list[tuple[dict, int]]) -> dict[str, torch.Tensor]:
        average = flower_average(replies)
        delta = {k: x - self.current[k] for k, x in average.items()}
        if not self.m_t:
            self.m_t = {k: np.zeros_like(v) for k, v in average.items()}
        self.m_t = {k: self.beta_1 * v + (1 - self.beta_1) * delta[k] for k, v in self.m_t.items()}
        if not self.v_t:
            self.v_t = {k: np.zeros_like(v) for k, v in average.items()}
        if self.kind == "adagrad":
            self.v_t = {k: v + delta[k] * delta[k] for k, v in self.v_t.items()}
        elif self.kind == "adam":
            self.v_t = {k: self.beta_2 * v + (1 - self.beta_2) * delta[k] ** 2 for k, v in self.v_t.items()}
        else:
            self.v_t = {
                k: v - (1.0 - self.beta_2) * delta[k] ** 2 * np.sign(v - delta[k] ** 2) for k, v in self.v_t.items()
            }
        eta = self.eta
        if self.kind == "adam":
            eta = (
                self.eta * np.sqrt(1 - self.beta_2 ** (server_round + 1.0)) / (1 - self.beta_1 ** (server_round + 1.0))
            )
        self.current = {k: x + eta * self.m_t[k] / (np.sqrt(self.v_t[k]) + self.tau) for k, x in self.current.items()}
        return {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in self.current.items()}


class Algorithm2:
    """Reddi et al., Algorithm 2 by hand (``kind``: adagrad, adam, yogi), with v starting at τ² (its
    v_{-1} ≥ τ²) and the client updates weighted by training-set size (Algorithm 2's 1/|S| when the
    clients hold as many samples): Δ = Σ p_i (x_i − x), m = β1 m + (1 − β1) Δ, v by ``kind``,
    x ← x + η m / (√v + τ); no bias correction."""

    def __init__(self, kind: str, initial: dict, eta: float, beta1: float, beta2: float, tau: float) -> None:
        self.kind, self.eta, self.beta1, self.beta2, self.tau = kind, eta, beta1, beta2, tau
        self.x = {k: v.double() for k, v in initial.items()}
        self.m = {k: torch.zeros_like(v) for k, v in self.x.items()}
        self.v = {k: torch.full_like(v, tau**2) for k, v in self.x.items()}

    def round(self, replies: list[tuple[dict, int]]) -> dict[str, torch.Tensor]:
        total = sum(n for _, n in replies)
        for k, x in self.x.items():
            delta = sum((n / total) * (p[k].double() - x) for p, n in replies)
            self.m[k] = self.beta1 * self.m[k] + (1 - self.beta1) * delta
            if self.kind == "adagrad":
                self.v[k] = self.v[k] + delta**2
            elif self.kind == "adam":
                self.v[k] = self.beta2 * self.v[k] + (1 - self.beta2) * delta**2
            else:
                self.v[k] = self.v[k] - (1 - self.beta2) * delta**2 * torch.sign(self.v[k] - delta**2)
            self.x[k] = x + self.eta * self.m[k] / (self.v[k].sqrt() + self.tau)
        return {k: v.float() for k, v in self.x.items()}


def server_rounds(name: str, make_reference, *overrides: str, rounds: int = 4, seed: int = 0) -> None:
    """``rounds`` rounds of ``name``'s server rule (configured by ``overrides``) and of the reference
    that ``make_reference(initial global)`` starts (``round(t, replies)``, or ``round(replies)`` for
    ``Algorithm2``) on the same uploads: 2 to 4 clients a round with random training-set sizes and
    parameters near the current global model; the global models must agree after every round."""
    from pflkit.algorithms.base import upload_order
    from tests.support.builders import build, params_of, perturbed, tiny_context
    from tests.support.checks import assert_expected_close

    ctx = tiny_context()
    alg = build(name, ctx, *overrides)
    server = alg.init_server(params_of(ctx, seed))
    reference = make_reference(server["global"])
    rng = np.random.default_rng(seed)
    for t in range(1, rounds + 1):
        clients = sorted(rng.choice(6, size=int(rng.integers(2, 5)), replace=False).tolist())
        uploads = [
            {
                "params": perturbed(server["global"], 100 * t + c, 0.05),
                "num_samples": int(rng.integers(5, 60)),
                "client_id": c,
            }
            for c in clients
        ]
        replies = [(u["params"], u["num_samples"]) for u in sorted(uploads, key=upload_order)]
        if isinstance(reference, Algorithm2):
            expected = reference.round(replies)
        else:
            reference.configure_train(server["global"])
            expected = reference.round(t, replies)
        server = alg.aggregate(server, uploads, t)
        assert_expected_close(server["global"], expected)


def trained_rounds(name: str, make_reference, *overrides: str, rounds: int = 3) -> None:
    """``rounds`` whole rounds of ``name`` on two training clients (30 and 50 samples): each trains
    from the downloaded global model and uploads; ``name``'s server rule and the reference that
    ``make_reference(initial global)`` starts (``round(t, replies)``) take the same uploads, and the
    global models must agree after every round."""
    from pflkit.algorithms.base import upload_order
    from tests.support.builders import build, params_of, seeded_client
    from tests.support.checks import assert_expected_close

    ctxs = [seeded_client(30, seed=0, client_id=0, lr=0.05), seeded_client(50, seed=1, client_id=1, lr=0.05)]
    alg = build(name, ctxs[0], *overrides)
    server = alg.init_server(params_of(ctxs[0], 0))
    reference = make_reference(server["global"])
    states = [alg.init_client(server["global"], c.client_id) for c in ctxs]
    for t in range(1, rounds + 1):
        uploads = []
        for i, ctx in enumerate(ctxs):
            payload = alg.downlink(server, ctx.client_id, t)
            state, _ = alg.local_init(payload, states[i], ctx)
            states[i], upload, _ = alg.local_train(payload, state, ctx)
            uploads.append({**upload, "num_samples": int(upload["num_samples"]), "client_id": ctx.client_id})
        reference.configure_train(server["global"])
        expected = reference.round(t, [(u["params"], u["num_samples"]) for u in sorted(uploads, key=upload_order)])
        server = alg.aggregate(server, uploads, t)
        assert_expected_close(server["global"], expected)

"""Transcriptions of reference code that several method files compare pflkit with.

Each is plain PyTorch written from reading the reference named in its docstring (never copied),
following its structure: its optimiser, step order, batch use, loss terms and server rule. The
transcriptions that one method's tests alone use live beside them in tests/methods/test_<method>.py.
"""

from __future__ import annotations

import copy
import functools

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

"""The pieces local training is made of: forward passes over parameter dicts, batches, losses,
gradients and the SGD update.

Models are used as stateless skeletons: the parameters always come from the caller, so one
module serves every client and no client state can leak. A loss function is a pure function
``loss(net, params, batch, aux) -> scalar`` of the model's forward ``net``, the full parameter
dict, a :class:`Batch` and ``aux`` (per-client tensors the loss reads: an anchor model, a
teacher, ...). Written this way, the same loss runs for one client (plain autograd) and for many
clients at once (``torch.func.vmap`` over the clients' stacked tensors); a batch of a batched
context carries a ``mask`` of real samples because clients smaller than a batch are padded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from .params import Params


class NonFiniteLossError(FloatingPointError):
    """A training loss became NaN or infinite."""


class Batch(NamedTuple):
    """Inputs, labels and (batched contexts only) the mask of real samples, 1.0 / 0.0 per row."""

    x: Tensor
    y: Tensor
    mask: Tensor | None = None


class Net(Protocol):
    """A model's forward over a parameter dict: units ``start..stop-1`` (all by default)."""

    def __call__(self, params: Mapping[str, Tensor], x: Tensor, start: int = 0, stop: int | None = None, *,
                 train: bool = True) -> Tensor: ...


LossFn = Callable[[Net, Params, Batch, Any], Tensor]


def forward(model: nn.Module, params: Mapping[str, Tensor], x: Tensor, start: int = 0,
            stop: int | None = None, *, train: bool = False) -> Tensor:
    """Run units ``start..stop-1`` of a model with ``params`` (all units by default).

    ``params`` holds the parameters and, for models with batch norm, the running statistics
    (``buffer_names(model)``). ``train=True`` is the training-mode forward: batch norm uses the
    batch statistics and updates the running statistics in ``params`` **in place** (pass clones
    you own); ``train=False`` uses them. Models without buffers ignore the flag.

    pflkit models apply their units as pure functions of the parameter dict; other modules go
    through ``torch.func.functional_call`` (in the module mode ``train`` asks for).
    """
    apply_units = getattr(model, "apply_units", None)
    if apply_units is not None:
        return apply_units(params, x, start, stop, train=train)
    if model.training != train:
        model.train(train)
    if start == 0 and stop is None:
        return functional_call(model, dict(params), (x,))
    return functional_call(model, dict(params), (x,), {"start": start, "stop": stop})


def net_of(model: nn.Module) -> Net:
    """``model``'s forward as a :class:`Net` (training mode unless asked otherwise)."""
    def net(params: Mapping[str, Tensor], x: Tensor, start: int = 0, stop: int | None = None, *,
            train: bool = True) -> Tensor:
        return forward(model, params, x, start, stop, train=train)
    return net


def batch_mean(values: Tensor, batch: Batch) -> Tensor:
    """Mean of per-sample ``values`` over the batch's real samples."""
    if batch.mask is None:
        return values.mean()
    return (values * batch.mask).sum() / batch.mask.sum()


def cross_entropy(logits: Tensor, batch: Batch) -> Tensor:
    """Mean cross-entropy over the batch's real samples."""
    if batch.mask is None:
        return F.cross_entropy(logits, batch.y)
    return batch_mean(F.cross_entropy(logits, batch.y, reduction="none"), batch)


def classification_loss(net: Net, params: Params, batch: Batch, aux: Any = None) -> Tensor:
    """Cross-entropy of the model on the batch: FedAvg's local objective."""
    return cross_entropy(net(params, batch.x), batch)


def squared_distance(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tensor:
    """Sum over the tensors of ``a`` of ||a_k - b_k||^2 (a differentiable scalar)."""
    return sum(((a[k] - b[k]) ** 2).sum() for k in a)  # type: ignore[return-value]


def proximal_loss(loss: LossFn, mu: float, anchor_key: str = "anchor") -> LossFn:
    """``loss + mu / 2 * ||w - anchor||^2`` over the trained parameters (FedProx, Ditto, FedAMP);
    the anchor is ``aux[anchor_key]``, a parameter dict."""
    if not mu:
        return loss

    def with_proximal(net: Net, params: Params, batch: Batch, aux: Any) -> Tensor:
        anchor = aux[anchor_key]
        return loss(net, params, batch, aux) + mu / 2 * squared_distance({k: params[k] for k in anchor}, anchor)
    return with_proximal


GradFn = Callable[..., tuple[dict[str, Tensor], Tensor]]


def autograd_value_and_grad(fn: Callable[..., Tensor]) -> GradFn:
    """``fn(trainable, *args) -> (grads of trainable, value)`` by plain autograd: one client,
    lower per-call overhead than ``torch.func.grad_and_value`` (which the batched path vmaps)."""
    def value_and_grad(trainable: Mapping[str, Tensor], *args: Any) -> tuple[dict[str, Tensor], Tensor]:
        leaves = {k: v.detach().requires_grad_(True) for k, v in trainable.items()}
        value = fn(leaves, *args)
        grads = torch.autograd.grad(value, list(leaves.values()))
        return dict(zip(leaves, grads)), value.detach()
    return value_and_grad


@dataclass(frozen=True)
class SGD:
    """Mini-batch SGD as ``torch.optim.SGD`` (no dampening, no Nesterov): with weight decay
    g <- g + wd * w; with momentum b <- m * b + g (b = g at the first step); w <- w - lr * b.
    ``lrs`` gives some parameters their own learning rate. Its state (the momentum buffers) is
    created fresh by every ``fit`` call: optimiser state does not carry across rounds."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    lrs: Mapping[str, float] = field(default_factory=dict)

    def init(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {k: torch.zeros_like(v) for k, v in params.items()} if self.momentum else {}

    @torch.no_grad()
    def update_(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor], state: Mapping[str, Tensor],
                rows: slice | None = None) -> None:
        """Update ``params[k]`` (``params[k][rows]``: the running clients of a batched context) in place."""
        names = list(grads)
        leaves = [params[k] if rows is None else params[k][rows] for k in names]
        steps = [grads[k] for k in names]
        if self.weight_decay:
            steps = torch._foreach_add(steps, leaves, alpha=self.weight_decay)
        if self.momentum:
            buffers = [state[k] if rows is None else state[k][rows] for k in names]
            torch._foreach_mul_(buffers, self.momentum)
            torch._foreach_add_(buffers, steps)
            steps = buffers
        if not self.lrs:
            torch._foreach_add_(leaves, steps, alpha=-self.lr)
            return
        for name, leaf, step in zip(names, leaves, steps):
            leaf.add_(step, alpha=-self.lrs.get(name, self.lr))


def check_finite(loss_sum: Tensor | float, where: str) -> None:
    if not math.isfinite(float(loss_sum)):
        raise NonFiniteLossError(
            f"training loss became {float(loss_sum)} ({where}); lower the learning rate "
            "or check the data for NaN/inf values")


@torch.no_grad()
def evaluate(model: nn.Module, params: Mapping[str, Tensor], x: Tensor, y: Tensor,
             batch_size: int = 1000) -> dict[str, float]:
    """Correct predictions, summed cross-entropy and sample count of ``params`` on (x, y)
    (evaluation mode: batch norm uses the running statistics in ``params``)."""
    correct = 0
    loss = 0.0
    for start in range(0, len(y), batch_size):
        logits = forward(model, params, x[start:start + batch_size], train=False)
        target = y[start:start + batch_size]
        correct += int((logits.argmax(1) == target).sum())
        loss += float(F.cross_entropy(logits, target, reduction="sum"))
    return {"correct": correct, "loss_sum": loss, "num_samples": int(len(y))}

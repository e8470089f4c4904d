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
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from .params import Params


class NonFiniteLossError(FloatingPointError):
    """A training loss became NaN or infinite."""


class Batch(NamedTuple):
    """Inputs, labels and (batched contexts only) the mask of real samples, 1.0 / 0.0 per row.

    A mixup batch (Zhang et al. 2018) holds the mixed inputs lam * x + (1 - lam) * x[perm], the
    partner labels ``y_mix`` = y[perm] and ``lam``; label losses weigh y by lam and y_mix by
    1 - lam (``cross_entropy`` does)."""

    x: Tensor
    y: Tensor
    mask: Tensor | None = None
    y_mix: Tensor | None = None
    lam: Tensor | None = None


class Net(Protocol):
    """A model's forward over a parameter dict: units ``start..stop-1`` (all by default)."""

    def __call__(
        self, params: Mapping[str, Tensor], x: Tensor, start: int = 0, stop: int | None = None, *, train: bool = True
    ) -> Tensor: ...


LossFn = Callable[[Net, Params, Batch, Any], Tensor]
#: A loss that also updates tensors it carries from step to step (``fit(carry=...)``): it returns
#: ``(value, {name: new value})``.
CarryLossFn = Callable[[Net, Params, Batch, Any], tuple[Tensor, Params]]


def forward(
    model: nn.Module,
    params: Mapping[str, Tensor],
    x: Tensor,
    start: int = 0,
    stop: int | None = None,
    *,
    train: bool = False,
) -> Tensor:
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


#: Rows per forward when a CPU computes without gradients (features, evaluation): one large batch's
#: activations are larger than what ``malloc`` keeps, so they are mapped afresh and page-faulted in
#: at every call (FedAvgCNN on MNIST: 1,600 rows in one batch take 1.8x the time of 64-row chunks).
CPU_FEATURE_ROWS = 64


def in_row_chunks(fn: Callable[[Tensor], Tensor], x: Tensor, rows: int | None = None) -> Tensor:
    """``fn(x)`` over chunks of ``rows`` rows, concatenated (default: ``CPU_FEATURE_ROWS`` on the
    CPU, one call elsewhere). For a forward without batch statistics each row's output is its own,
    so only the memory changes (up to the convolution kernel a chunk's shape selects: the same
    bits on the CPUs measured, float rounding in general)."""
    rows = rows or (CPU_FEATURE_ROWS if x.device.type == "cpu" else len(x))
    if len(x) <= rows:
        return fn(x)
    return torch.cat([fn(x[i : i + rows]) for i in range(0, len(x), rows)])


@torch.no_grad()
def features_of(
    model: nn.Module, params: Mapping[str, Tensor], x: Tensor, stop: int, *, rows: int | None = None
) -> Tensor:
    """Units ``0..stop-1`` over ``x`` (training-mode forward, no gradient), in chunks of ``rows``
    (:func:`in_row_chunks`)."""
    return in_row_chunks(lambda inputs: forward(model, params, inputs, stop=stop, train=True), x, rows)


def net_of(model: nn.Module) -> Net:
    """``model``'s forward as a :class:`Net` (training mode unless asked otherwise)."""

    def net(
        params: Mapping[str, Tensor], x: Tensor, start: int = 0, stop: int | None = None, *, train: bool = True
    ) -> Tensor:
        return forward(model, params, x, start, stop, train=train)

    return net


def batch_mean(values: Tensor, batch: Batch) -> Tensor:
    """Mean of per-sample ``values`` over the batch's real samples. A padding row's value is
    dropped, not multiplied by 0: it may be infinite (a method's -inf logit of a class the client
    lacks, on a padding row of another class)."""
    if batch.mask is None:
        return values.mean()
    return torch.where(batch.mask > 0, values * batch.mask, 0.0).sum() / batch.mask.sum()


def cross_entropy(logits: Tensor, batch: Batch) -> Tensor:
    """Mean cross-entropy over the batch's real samples (label-weighted on mixup batches)."""
    return label_loss(
        lambda y: F.cross_entropy(logits, y, reduction="none"), batch, mean=lambda: F.cross_entropy(logits, batch.y)
    )


def label_loss(
    per_sample: Callable[[Tensor], Tensor], batch: Batch, mean: Callable[[], Tensor] | None = None
) -> Tensor:
    """Mean over the batch of a per-sample loss of the labels, ``per_sample(y)``; on a mixup
    batch lam * loss(y) + (1 - lam) * loss(y_mix). ``mean`` computes the plain unmasked case
    directly (kept for its exact numerics)."""
    if batch.lam is not None:
        assert batch.y_mix is not None
        return batch_mean(batch.lam * per_sample(batch.y) + (1 - batch.lam) * per_sample(batch.y_mix), batch)
    if batch.mask is None and mean is not None:
        return mean()
    return batch_mean(per_sample(batch.y), batch)


def mix(x: Tensor, y: Tensor, lam: float | Tensor, perm: Tensor) -> Batch:
    """The mixup batch of (x, y) for the coefficient ``lam`` and partner order ``perm``."""
    lam_t = torch.as_tensor(lam, dtype=x.dtype, device=x.device)
    if not x.is_floating_point():
        raise ValueError("mixup needs real-valued inputs (images), not token ids")
    mixed = lam_t.reshape(lam_t.shape + (1,) * (x.dim() - lam_t.dim())) * x
    partner = (
        x[perm] if perm.dim() == 1 else torch.gather(x, 1, perm.reshape(perm.shape + (1,) * (x.dim() - 2)).expand_as(x))
    )
    partner_y = y[perm] if perm.dim() == 1 else torch.gather(y, 1, perm)
    lam_p = lam_t.reshape(lam_t.shape + (1,) * (x.dim() - lam_t.dim()))
    return Batch(mixed + (1 - lam_p) * partner, y, None, partner_y, lam_t)


def classification_loss(net: Net, params: Params, batch: Batch, aux: Any = None) -> Tensor:
    """Cross-entropy of the model on the batch: FedAvg's local objective."""
    return cross_entropy(net(params, batch.x), batch)


def one_hot(y: Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """One-hot rows of the labels ``y`` (by comparison, which vmap batches)."""
    return (y[..., None] == torch.arange(num_classes, device=y.device)).to(dtype)


def squared_distance(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tensor:
    """Sum over the tensors of ``a`` of ||a_k - b_k||^2 (a differentiable scalar)."""
    return cast(Tensor, sum(((a[k] - b[k]) ** 2).sum() for k in a))  # (sum's start 0 is absorbed by a tensor)


class ClosedFormTerm(ABC):
    """A term of a local objective whose gradient is known in closed form (a proximal pull, a fixed
    linear correction). ``fit`` adds that gradient to the autograd gradient of the rest, instead of
    differentiating the term at every step (fewer elementwise passes and kernel launches); the
    numbers are the same bit for bit when ``gradient`` computes what autograd would."""

    @abstractmethod
    def add_value(self, value: Tensor, params: Params, aux: Any) -> Tensor:
        """``value`` with the term added, as the whole objective computes it (differentiable)."""

    @abstractmethod
    def gradient(self, params: Params, aux: Any) -> dict[str, Tensor]:
        """The term's gradient for the parameters it reads (``params`` may have leading client dims)."""

    def add_value_only(self, value: Tensor, params: Params, aux: Any) -> Tensor:
        """``add_value`` for the reported loss, without autograd (a term may skip work here)."""
        return self.add_value(value, params, aux)

    def apply(self, value: Tensor, params: Params, grads: dict[str, Tensor], aux: Any) -> Tensor:
        """One client's step: its gradient added to ``grads`` (the trained parameters' entries, in
        place) and the value with the term added. A term may override it with multi-tensor
        (``torch._foreach_*``) forms of the same arithmetic."""
        self.add_gradient(params, grads, aux)
        return self.add_value_only(value, params, aux)

    def add_gradient(self, params: Params, grads: dict[str, Tensor], aux: Any) -> None:
        """The term's gradient added to the entries of ``grads`` it has (in place)."""
        for k, g in self.gradient(params, aux).items():
            if k in grads:
                grads[k] = grads[k] + g


@dataclass(frozen=True)
class WithTerms:
    """``base`` plus closed-form ``terms``: called, the whole objective (autograd differentiates every
    part); ``fit`` differentiates ``base`` only and adds each term's gradient."""

    base: LossFn
    terms: tuple[ClosedFormTerm, ...]

    def __call__(self, net: Net, params: Params, batch: Batch, aux: Any) -> Tensor:
        value = self.base(net, params, batch, aux)
        for term in self.terms:
            value = term.add_value(value, params, aux)
        return value


@dataclass(frozen=True)
class ProximalTerm(ClosedFormTerm):
    """``mu / 2 * ||w - anchor||^2`` over the anchor's parameters (``aux[anchor_key]``); its
    gradient is ``mu * (w - anchor)``."""

    mu: float
    anchor_key: str = "anchor"

    def add_value(self, value: Tensor, params: Params, aux: Any) -> Tensor:
        anchor = aux[self.anchor_key]
        return value + self.mu / 2 * squared_distance({k: params[k] for k in anchor}, anchor)

    def gradient(self, params: Params, aux: Any) -> dict[str, Tensor]:
        anchor = aux[self.anchor_key]
        return {k: self.mu * (params[k] - a) for k, a in anchor.items()}

    def apply(self, value: Tensor, params: Params, grads: dict[str, Tensor], aux: Any) -> Tensor:
        anchor = aux[self.anchor_key]
        names = list(anchor)
        gaps = torch._foreach_sub([params[k] for k in names], [anchor[k] for k in names])
        value = value + self.mu / 2 * sum(s.sum() for s in torch._foreach_mul(gaps, gaps))
        torch._foreach_mul_(gaps, self.mu)
        trained = [i for i, k in enumerate(names) if k in grads]
        summed = torch._foreach_add([grads[names[i]] for i in trained], [gaps[i] for i in trained])
        grads.update(zip((names[i] for i in trained), summed))
        return value


def proximal_loss(loss: LossFn, mu: float, anchor_key: str = "anchor") -> LossFn:
    """``loss + mu / 2 * ||w - anchor||^2`` over the trained parameters (FedProx, Ditto, FedAMP);
    the anchor is ``aux[anchor_key]``, a parameter dict. Training adds the proximal gradient
    ``mu (w - anchor)`` in closed form (:class:`WithTerms`)."""
    if not mu:
        return loss
    return WithTerms(loss, (ProximalTerm(mu, anchor_key),))


def base_loss(loss: Any) -> Any:
    """The part of ``loss`` that autograd differentiates in ``fit`` (a :class:`WithTerms`'s base)."""
    return loss.base if isinstance(loss, WithTerms) else loss


def add_terms(
    loss: Any,
    value: Tensor,
    grads: dict[str, Tensor],
    params: Params,
    aux: Any,
    add_value: Callable[[ClosedFormTerm, Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``value`` and ``grads`` of a :class:`WithTerms` loss's base made the whole objective's: each
    term's closed-form gradient added on the trained parameters, and its value. One client
    (``add_value`` None): ``term.apply``; clients with a leading dim: each client's value by
    ``add_value(term, value)``. Any other loss: unchanged."""
    if not isinstance(loss, WithTerms):
        return value, grads
    with torch.no_grad():
        for term in loss.terms:
            if add_value is None:
                value = term.apply(value, params, grads, aux)
            else:
                term.add_gradient(params, grads, aux)
                value = add_value(term, value)
    return value, grads


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
    ``lrs`` gives some parameters their own learning rate; ``plain`` names parameters stepped
    by plain SGD (no weight decay, no momentum: FedROD's personal head); ``decays`` gives some
    parameters their own weight decay in place of ``weight_decay`` (GPFL's CoV and GCE, which are also
    ``plain``: their own optimiser in the authors' code). ``clip_norm`` first scales the
    gradients so that their global L2 norm is at most ``clip_norm``
    (``torch.nn.utils.clip_grad_norm_``: coefficient min(1, clip_norm / (norm + 1e-6)); per client
    in a batched context). Its state (the momentum buffers) is created fresh by every ``fit``
    call: optimiser state does not carry across rounds."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    lrs: Mapping[str, float] = field(default_factory=dict)
    clip_norm: float | None = None
    plain: frozenset[str] = frozenset()
    decays: Mapping[str, float] = field(default_factory=dict)

    def init(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {k: torch.zeros_like(v) for k, v in params.items()} if self.momentum else {}

    @torch.no_grad()
    def update_(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        state: Mapping[str, Tensor],
        rows: slice | None = None,
    ) -> None:
        """Update ``params[k]`` (``params[k][rows]``: the running clients of a batched context) in place."""
        names = list(grads)
        leaves = [params[k] if rows is None else params[k][rows] for k in names]
        steps = [grads[k] for k in names]
        if self.clip_norm is not None:
            steps = clip_by_global_norm(steps, self.clip_norm, batched=rows is not None)
        shaped = [i for i, k in enumerate(names) if k not in self.plain]  # weight decay and momentum apply
        groups: dict[float, list[int]] = {}
        for i, k in enumerate(names):
            decay = self.decays.get(k, self.weight_decay if i in shaped else 0.0)
            if decay:
                groups.setdefault(decay, []).append(i)
        for decay, at in groups.items():
            steps = _put(steps, at, torch._foreach_add([steps[i] for i in at], [leaves[i] for i in at], alpha=decay))
        if self.momentum and shaped:
            buffers = [state[names[i]] if rows is None else state[names[i]][rows] for i in shaped]
            torch._foreach_mul_(buffers, self.momentum)
            torch._foreach_add_(buffers, [steps[i] for i in shaped])
            steps = _put(steps, shaped, buffers)
        if not self.lrs:
            torch._foreach_add_(leaves, steps, alpha=-self.lr)
            return
        for name, leaf, step in zip(names, leaves, steps):
            leaf.add_(step, alpha=-self.lrs.get(name, self.lr))


def _put(items: Sequence[Tensor], at: Sequence[int], values: Sequence[Tensor]) -> list[Tensor]:
    out = list(items)
    for i, v in zip(at, values):
        out[i] = v
    return out


def clip_by_global_norm(grads: Sequence[Tensor], max_norm: float, batched: bool = False) -> list[Tensor]:
    """``grads`` scaled by min(1, max_norm / (||grads|| + 1e-6)), the norm over all of them
    (``batched``: one norm per client, the leading dimension)."""
    if batched:
        squares = cast(Tensor, sum(g.pow(2).reshape(len(g), -1).sum(1) for g in grads))  # (grads: not empty)
        coef = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        return [g * coef.view(-1, *([1] * (g.dim() - 1))) for g in grads]
    norm = cast(Tensor, sum(g.pow(2).sum() for g in grads)).sqrt()  # (grads: not empty)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return [g * coef for g in grads]


def check_finite(loss_sum: Tensor | float, where: str) -> None:
    if not math.isfinite(float(loss_sum)):
        raise NonFiniteLossError(
            f"training loss became {float(loss_sum)} ({where}); lower the learning rate "
            "or check the data for NaN/inf values"
        )


class Ensemble(list):
    """Several parameter dicts scored as one model: the mean of their softmax outputs (SosicFL's
    Omega_te > 1). ``eval_params`` may return one; evaluation then scores the ensemble."""


def prediction_logits(
    model: nn.Module, params: Mapping[str, Tensor] | Ensemble, x: Tensor, run: Callable[..., Tensor] | None = None
) -> Tensor:
    """Evaluation-mode logits of ``params``; an :class:`Ensemble` gives the log of its members'
    mean softmax (so argmax and cross-entropy score the ensemble). ``run(params, x)`` replaces
    the forward (a vmapped one for batched clients); the default one runs in
    :func:`in_row_chunks`."""
    run = run or (lambda p, inputs: in_row_chunks(lambda rows: forward(model, p, rows, train=False), inputs))
    if isinstance(params, Ensemble):
        probs = torch.stack([torch.softmax(run(p, x), dim=-1) for p in params]).mean(0)
        return probs.clamp_min(1e-30).log()
    return run(params, x)


@torch.no_grad()
def evaluate(
    model: nn.Module, params: Mapping[str, Tensor] | Ensemble, x: Tensor, y: Tensor, batch_size: int = 1000
) -> dict[str, float]:
    """Correct predictions, summed cross-entropy and sample count of ``params`` on (x, y)
    (evaluation mode: batch norm uses the running statistics in ``params``)."""
    correct = 0
    loss = 0.0
    for start in range(0, len(y), batch_size):
        logits = prediction_logits(model, params, x[start : start + batch_size])
        target = y[start : start + batch_size]
        correct += int((logits.argmax(1) == target).sum())
        loss += float(F.cross_entropy(logits, target, reduction="sum"))
    return {"correct": correct, "loss_sum": loss, "num_samples": int(len(y))}


@torch.no_grad()
def probability_sums(
    model: nn.Module,
    params: Mapping[str, Tensor] | Ensemble,
    x: Tensor,
    y: Tensor,
    num_classes: int,
    batch_size: int = 1000,
) -> Tensor:
    """[C, C]: row i sums the predicted probabilities (evaluation mode) over the samples of class i."""
    out = torch.zeros(num_classes, num_classes, device=x.device)
    for start in range(0, len(y), batch_size):
        probs = torch.softmax(prediction_logits(model, params, x[start : start + batch_size]), dim=-1)
        out.index_add_(0, y[start : start + batch_size], probs)
    return out


def probability_matrix(sums: Tensor, counts: Tensor, floor: float = 1e-8) -> Tensor:
    """P: the mean predicted probabilities per true class (rows of absent classes are uniform),
    floored at ``floor`` (FedACD's P^m). Works with a leading client dimension."""
    uniform = torch.full_like(sums, 1.0 / sums.shape[-1])
    present = (counts > 0)[..., None]
    return torch.where(present, sums / counts.clamp(min=1)[..., None], uniform).clamp(min=floor)


def template_kl(P: Tensor, counts: Tensor, gamma: float, rows: str = "mean") -> Tensor:
    """s = mean over the classes present (counts > 0) of KL(P_i || T_i), with the template
    T_ii = gamma, T_ij = (1 - gamma) / (C - 1) (FedACD Eq. 10, reconstructed);
    ``rows = "samples"`` weights each class's row by its sample count instead."""
    C = P.shape[-1]
    eye = torch.eye(C, dtype=P.dtype, device=P.device)
    T = eye * gamma + (1 - eye) * ((1 - gamma) / (C - 1))
    kl = (P * (P.log() - T.log())).sum(-1)
    weight = (counts > 0).to(P.dtype) if rows == "mean" else counts.to(P.dtype)
    return (kl * weight).sum(-1) / weight.sum(-1).clamp(min=1e-12)

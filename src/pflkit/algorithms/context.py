"""What an algorithm's client functions may use: the client-context protocol.

Client code is written once against :class:`ClientContext`. An engine hands it either one
client's context (tensors as they are) or a batched context (every tensor of the payload and the
state carries a leading client dimension, and ``fit`` advances all clients at once with
``torch.func.vmap``). Client code therefore trains only through ``ctx.fit`` with a loss function
or a pure step function, and computes everything else with tensor operations that broadcast
over a leading dimension. Code that needs one client's values in Python (a loop over downloaded
models, a branch on a random draw) declares the capability ``"per_client"`` in
``Algorithm.needs``; engines then give it per-client contexts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from ..functional.params import Params
from ..functional.training import SGD, CarryLossFn, GradFn, LossFn, Net
from ..models import UnitModel, Units

#: A per-client value: a tensor of shape ``ctx.client_shape`` (0-dim for one client, [K] for K).
PerClient = Tensor
#: A client function's metrics: per-client tensors (ALA's per-epoch losses: lists).
Metrics = dict[str, Any]

#: Capabilities a context may provide; an algorithm lists what it needs in ``Algorithm.needs``.
PER_CLIENT = "per_client"  # client code reads values into Python (loops over models, branches on draws)


class TrainSettings(BaseModel):
    """Local-training settings shared by every algorithm: the ``[train]`` section of
    the experiment config (its flat keys ``lr``, ``batch_size``, ``rounds``, ... are aliases)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    batch_size: int = Field(10, ge=1, description="local training batch size")
    local_epochs: int = Field(1, ge=1, description="local epochs per round (E)")
    lr: float = Field(0.1, gt=0, description="local SGD learning rate")
    lr_decay: float = Field(
        1.0,
        gt=0,
        le=1,
        description="per-round learning-rate factor: round r trains at "
        "lr * lr_decay**(r - 1) (FedNH's and FedNTD's code: 0.99; 1: constant)",
    )
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (optimiser state starts fresh every round)")
    weight_decay: float = Field(0.0, ge=0, description="SGD weight decay (L2 added to the gradient)")
    mixup: bool = Field(
        False, description="input mixup in every local training batch (Zhang et al. 2018; FedACD Table 5)"
    )
    mixup_alpha: float = Field(1.0, gt=0, description="mixup: lambda ~ Beta(mixup_alpha, mixup_alpha)")
    eval_batch_size: int = Field(1000, ge=1, description="batch size of evaluation (memory only: same scores)")
    rounds: int = Field(
        60,
        ge=1,
        description="T, the run's training rounds (the driver's, and FedPHP's, APPLE's and lr_decay's schedules)",
    )
    bn_buffers: Literal["local", "global"] = Field(
        "local",
        description="batch-norm running statistics: kept by each client (local, PFLlib's behaviour) "
        "or downloaded with the global model (global); the server averages them either way",
    )

    def at_round(self, round: int) -> TrainSettings:
        """The settings of round ``round`` (1, 2, ...): lr * lr_decay**(round - 1), as FedNH's and
        FedNTD's code decay it (round 0, the initial evaluation, uses lr; the final pass, round T's rate)."""
        if self.lr_decay == 1.0:
            return self
        return self.model_copy(
            update={"lr": self.lr * self.lr_decay ** max(min(round, self.rounds) - 1, 0), "lr_decay": 1.0}
        )

    def optimizer(
        self, lr: float | None = None, *, clip_norm: float | None = None, plain: Iterable[str] = (), **lrs: float
    ) -> SGD:
        """The local optimiser at the local lr (or ``lr``); ``lrs`` set per-parameter rates;
        ``clip_norm`` clips the gradients' global norm; ``plain`` parameters get neither weight
        decay nor momentum."""
        return SGD(self.lr if lr is None else lr, self.momentum, self.weight_decay, lrs, clip_norm, frozenset(plain))


# ---- what a fit iterates over (the engines' schedule module draws the batches) -----------------
@dataclass(frozen=True)
class TrainBatches:
    """The client's training samples in mini-batches of ``batch_size`` (default: the run's),
    reshuffled every epoch from the stream ``purpose``; full batches only (drop_last), except
    that a client with fewer samples than one batch trains on one batch of all of them.
    ``holdout`` keeps the last share of the training data out (FedFomo validates on it);
    ``max_steps`` stops after that many batches. ``mixup`` (None: the run's ``mixup`` setting)
    mixes every batch (lam ~ Beta(a, a) and a partner order from the stream ``purpose/mixup``)."""

    purpose: str = "train"
    epochs: int = 1
    batch_size: int | None = None
    holdout: float = 0.0
    max_steps: int | None = None
    mixup: bool | None = None


@dataclass(frozen=True)
class PairedBatches:
    """Several independent batch streams stepped together: each step gets a tuple of batches
    (Per-FedAvg's B and B', and B'' with the Hessian); as many steps as the shortest stream."""

    streams: tuple[TrainBatches | SplitBatches, ...]


@dataclass(frozen=True)
class SplitBatches:
    """Batches of ``2b`` split into halves (B = the first min(b, ceil(n/2)) samples, B' the rest;
    a batch of one sample is used for both): PFLlib's Per-FedAvg pairs."""

    purpose: str = "train"
    epochs: int = 1


@dataclass(frozen=True)
class SampleBatches:
    """A fixed sample (from ``ctx.sample``), in order, in batches of the run's batch size with
    the last partial batch kept, the same batches every epoch (ALA's weight learning)."""

    sample: Sample


DataSpec = TrainBatches | PairedBatches | SplitBatches | SampleBatches


@dataclass
class Sample:
    """Samples drawn from each client's training data: ``x`` [n, ...] and ``y`` [n]; in a batched
    context ``x`` [K, n_max, ...], ``y`` [K, n_max] and ``lengths`` [K] (padding beyond)."""

    x: Tensor
    y: Tensor
    lengths: Tensor | None = None

    def with_inputs(self, x: Tensor) -> Sample:
        return Sample(x, self.y, self.lengths)


@dataclass
class Fit:
    """The result of ``ctx.fit``: the parameters (every entry of the input dict; trained ones
    updated, batch-norm statistics updated by the training-mode forwards), and per client (tensors
    of shape ``ctx.client_shape``) the mean step loss (float64), the number of epochs with a step,
    the loss of the last step (NaN where no step ran) and the number of steps; for open-ended fits
    (``until``) the last-step loss of every epoch (batched: one list per client)."""

    params: Params
    loss: PerClient
    epochs: PerClient
    last_loss: PerClient
    steps: PerClient
    history: list[float] | list[list[float]] | None = None


#: A custom training step: ``step(value_and_grad, trainable, frozen, batch, aux) -> (trainable, loss)``,
#: a pure function (vmapped over clients by batched contexts). ``value_and_grad(fn)`` turns
#: ``fn(trainable, *args) -> scalar`` into ``(grads, value)``. A step written for tensors with a
#: leading client dimension as well is passed with ``fit(vectorized=True)``: batched contexts call
#: it directly (``value_and_grad`` is then None), without vmap.
StepFn = Callable[[Callable[[Callable[..., Tensor]], GradFn] | None, Params, Params, Any, Any], tuple[Params, Tensor]]
#: Called after each step on the trainable tensors (in place), e.g. a projection to [0, 1].
Transform = Callable[[Params], None]
#: Whether a client stops: called with its list of per-epoch last-step losses.
StopRule = Callable[[list[float], int], bool]
#: A per-sample map for ``class_sums``: ``fn(net, params, x, y) -> [b, ...]``.
SampleMap = Callable[[Net, Params, Tensor, Tensor], Tensor]
#: Called after each epoch with the carried tensors (``fit(carry=...)``); returns their new values.
EpochEnd = Callable[[Params], Params]


class ClientContext(Protocol):
    """One client, or K clients at once; see the module docstring."""

    round: int
    seed: int
    model: UnitModel
    units: Units
    train: TrainSettings
    algorithm: str

    @property
    def client_ids(self) -> list[int]: ...

    @property
    def client_shape(self) -> tuple[int, ...]:
        """The leading shape of per-client values: () for one client, (K,) for K batched clients
        (``torch.zeros(ctx.client_shape)`` is one number per client)."""

    def generator(self, purpose: str, k: int = 0) -> torch.Generator:
        """A fresh generator of client ``k`` (of ``client_ids``) for this round and ``purpose``: the
        same draws on every engine."""

    @property
    def client_index(self) -> PerClient:
        """The client's id (batched: a [K] tensor)."""

    @property
    def num_train(self) -> PerClient:
        """Training samples of the client (batched: a [K] tensor)."""

    @property
    def net(self) -> Net:
        """The model's forward over parameter dicts (works inside ``fit``'s losses and steps)."""

    @property
    def label_counts(self) -> Tensor:
        """The client's training samples per class [C] (batched: [K, C])."""

    def class_sums(self, params: Params, fn: SampleMap) -> Tensor:
        """Sums over the client's training samples, per true class, of ``fn(net, params, x, y)``
        (a per-sample map, evaluation mode, no gradient): [C, ...] (batched: [K, C, ...]).
        FedACD's probability matrix sums softmax outputs; FedNH sums normalised features."""

    def features(self, params: Params, sample: Sample, stop: int) -> Sample:
        """The sample with its inputs replaced by the output of units ``0..stop-1`` (training-mode
        forward, no gradient) on the client's parameters (batched: each client's own)."""

    def fit(
        self,
        params: Params,
        loss: LossFn | CarryLossFn | None = None,
        *,
        step: StepFn | None = None,
        vectorized: bool = False,
        trainable: Sequence[str] | None = None,
        aux: Any = None,
        data: DataSpec = TrainBatches(),
        optimizer: SGD | None = None,
        transform: Transform | None = None,
        until: StopRule | None = None,
        max_epochs: int = 1,
        active: PerClient | None = None,
        carry: Sequence[str] = (),
        epoch_end: EpochEnd | None = None,
        stage: str = "local training",
        start: int = 0,
    ) -> Fit:
        """Train ``trainable`` (default: every parameter, never batch-norm statistics) of
        ``params`` over ``data``: each step either minimises ``loss`` with ``optimizer`` (default:
        the run's SGD) or applies ``step`` (``vectorized``: the step also takes a leading client
        dimension, see ``StepFn``); ``transform`` follows every step. ``until`` makes
        the epochs open-ended (per client, at most ``max_epochs``); without it ``data`` fixes
        them. ``active`` (per client) leaves inactive clients' parameters unchanged. ``carry``
        names entries the loss updates itself: it then returns ``(value, {name: new value})``
        (e.g. running statistics of the batches); ``epoch_end`` maps them after every epoch in
        which the client took a step.
        ``start``: the units below it are frozen; where their forward is deterministic (no dropout
        or batch norm, no mixup, ``TrainBatches`` data) their output over the client's training
        data is computed once and every step runs from unit ``start`` on it (the loss's ``net``
        then starts there): FedRep's head epochs. Otherwise the whole model runs, the same function.
        Raises NonFiniteLossError naming the stage when a loss is NaN/inf."""

    def holdout(self, fraction: float) -> Sample:
        """The last ``fraction`` of the client's training samples, which ``TrainBatches(holdout=...)``
        leaves out (a client with one training sample validates on it); FedFomo's validation set."""

    def sample(self, purpose: str, fraction: float, sampling: str = "random") -> Sample:
        """At least one of the client's training samples: ``fraction`` of them, a uniform subset
        (``"random"``) or a contiguous run at a random offset (``"contiguous"``)."""

    def differs(self, a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> PerClient:
        """Whether any tensor of ``a`` differs from ``b``'s (per client)."""

    def where(self, stage: str) -> str:
        """Who and when, for error messages."""

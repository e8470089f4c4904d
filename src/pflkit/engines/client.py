"""One client's context: the reference implementation of ``ClientContext`` (plain loops, autograd).

Its batch orders, samples and losses are the ones every other context must reproduce: the
batched context draws the same (seed, round, client, purpose) streams and computes the same
losses on padded, masked batches.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..algorithms.context import (
    PER_CLIENT,
    DataSpec,
    EpochEnd,
    Fit,
    Metrics,
    PerClient,
    Sample,
    SampleBatches,
    SampleMap,
    StepFn,
    StopRule,
    TrainBatches,
    TrainSettings,
    Transform,
)
from ..data.federated import ClientData
from ..functional import Params, evaluate, torch_generator
from ..functional.training import (
    SGD,
    Batch,
    CarryLossFn,
    Ensemble,
    LossFn,
    Net,
    add_terms,
    autograd_value_and_grad,
    base_loss,
    features_of,
    net_of,
)
from ..models import UnitModel, Units, buffer_names, num_outputs, statistic_entries
from .fitting import FitTotals, check_cancel, check_fit_arguments, loss_value, run_epochs
from .plan import ClientPlan, materialize
from .schedule import holdout_positions, sample_positions


class SingleClientContext:
    """``ClientContext`` for one client (see ``pflkit.algorithms.context``)."""

    provides = frozenset({PER_CLIENT})
    client_shape: tuple[int, ...] = ()  # per-client values are 0-dim tensors

    def __init__(
        self,
        client_id: int,
        round: int,
        seed: int,
        data: ClientData,
        model: UnitModel,
        units: Units,
        train: TrainSettings,
        algorithm: str = "",
        cancel: threading.Event | None = None,
    ) -> None:
        """``cancel``: once set, training stops at its next step (JobsAbandoned)."""
        self.cancel = cancel
        self.client_id = client_id
        self.round = round
        self.seed = seed
        self.data = data
        self.model = model
        self.units = units
        self.train = train.at_round(round)  # the round's learning rate (lr_decay)
        self.algorithm = algorithm
        self.num_classes = num_outputs(model)
        self._net = net_of(model)
        self.work: dict[int, float] = {}  # client id -> share of its planned steps it takes (stragglers)

    # ---- who -------------------------------------------------------------------------------
    @property
    def client_ids(self) -> list[int]:
        return [self.client_id]

    @property
    def device(self) -> torch.device:
        return self.data.train_x.device

    @property
    def client_index(self) -> Tensor:
        return torch.tensor(self.client_id, device=self.device)

    @property
    def num_train(self) -> Tensor:
        return torch.tensor(self.data.num_train, device=self.device)

    @property
    def net(self) -> Net:
        return self._net

    def generator(self, purpose: str, k: int = 0) -> torch.Generator:
        """A fresh generator for (seed, round, client, purpose): the same draws on every engine."""
        return torch_generator(self.seed, "client", self.round, self.client_id, purpose)

    def where(self, stage: str) -> str:
        return f"algorithm {self.algorithm}, client {self.client_id}, round {self.round}, {stage}"

    # ---- data ------------------------------------------------------------------------------
    def plan(self, spec: DataSpec, sample: Sample | None = None) -> ClientPlan:
        """This client's steps of ``spec`` (see ``pflkit.engines.plan``)."""
        return ClientPlan(
            spec,
            self.data.num_train,
            self.train,
            self.seed,
            self.round,
            self.client_id,
            None if sample is None else len(sample.y),
            self.work.get(self.client_id, 1.0),
        )

    def batches(self, spec: TrainBatches = TrainBatches()) -> Iterator[Batch]:
        """The mini-batches of ``spec``, every epoch in turn (what ``fit`` steps through)."""
        plan = self.plan(spec)
        for _ in range(plan.epochs):
            for rows in plan.next_epoch():
                # the ignore below: TrainBatches' steps are single Rows, one Batch each (materialize's union)
                yield materialize(rows, self.data.train_x, self.data.train_y)  # type: ignore[misc]

    def sample(self, purpose: str, fraction: float, sampling: str = "random") -> Sample:
        x, y = self.data.train_x, self.data.train_y
        idx = sample_positions(len(y), fraction, sampling, self.generator(purpose)).to(x.device)
        return Sample(x[idx], y[idx])

    def holdout(self, fraction: float) -> Sample:
        rows = holdout_positions(self.data.num_train, fraction)
        return Sample(self.data.train_x[rows], self.data.train_y[rows])

    def differs(self, a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tensor:
        return torch.tensor(not all(torch.equal(a[k], b[k]) for k in a if k in b), device=self.device)

    @property
    def label_counts(self) -> Tensor:
        return torch.bincount(self.data.train_y, minlength=self.num_classes)

    @torch.no_grad()
    def class_sums(self, params: Params, fn: SampleMap) -> Tensor:
        return class_sums(
            self.net, params, fn, self.data.train_x, self.data.train_y, self.num_classes, self.train.eval_batch_size
        )

    @torch.no_grad()
    def features(self, params: Params, sample: Sample, stop: int) -> Sample:
        return sample.with_inputs(features_of(self.model, params, sample.x, stop))

    # ---- what the executor needs ------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, params: Params | Ensemble) -> list[dict[str, float]]:
        """The client's correct predictions, loss sum and test size (a list of one)."""
        return [evaluate(self.model, params, self.data.test_x, self.data.test_y, self.train.eval_batch_size)]

    @staticmethod
    def gather(values: list[Any]) -> Any:
        """The one client's value (a batched context stacks K of them)."""
        (value,) = values
        return value

    @staticmethod
    def split(value: Any, k: int, template: Any = None) -> Any:
        """The client's value; 0-dim tensors become the Python numbers ``template`` holds there."""
        return as_template(value, template)

    @staticmethod
    def split_metrics(metrics: Metrics, k: int) -> dict[str, Any]:
        """The client's metrics as Python values (0-dim tensors become numbers)."""
        return {key: v.item() if isinstance(v, Tensor) and v.dim() == 0 else v for key, v in metrics.items()}

    # ---- training --------------------------------------------------------------------------
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
        check_fit_arguments(loss, step, carry, epoch_end)
        start = cached_prefix(self.model, self.units, self.train, data, start, trainable or list(params))
        if isinstance(data, SampleBatches):
            x, y = data.sample.x, data.sample.y
        else:
            x, y = (
                features_of(self.model, params, self.data.train_x, start) if start else self.data.train_x,
                self.data.train_y,
            )
        plan = self.plan(data, data.sample if isinstance(data, SampleBatches) else None)
        buffers = statistic_entries(self.model, params)
        skip = set(buffers) | set(carry)
        names = [k for k in (params if trainable is None else trainable) if k not in skip]
        train = {k: params[k].detach().clone() for k in names}
        carried = {k: params[k].detach().clone() for k in carry}
        # training-mode forwards update batch-norm statistics in place: the caller's stay untouched
        stats = {k: params[k].detach().clone() for k in buffers}
        frozen = {
            **{k: v.detach() for k, v in params.items() if k not in train and k not in stats and k not in carried},
            **stats,
        }
        net = self.net if not start else from_unit(self.net, start)
        current = {**frozen, **carried, **train}
        if step is None:
            assert loss is not None
            opt = optimizer or self.train.optimizer()
            opt_state = opt.init(train)
            # the trained tensors are leaves updated in place: one dict of them serves every step
            leaves = [v.requires_grad_(True) for v in train.values()]
            current = {**frozen, **carried, **train}

        def run_epoch(epoch: int, running: list[int], totals: FitTotals) -> list[int]:
            nonlocal train
            loss_sum, count, last = totals.loss_sum[0], 0, None  # (a view: sums in place, step by step)
            for rows in plan.next_epoch():
                check_cancel(self.cancel, self.where(stage))
                batch = materialize(rows, x, y)
                if step is None:
                    assert loss is not None
                    value, updates = loss_value(base_loss(loss), net, current, batch, aux, carry)
                    if carry:
                        current.update({k: updates[k].detach() for k in carry})
                    grads = dict(zip(train, torch.autograd.grad(value, leaves)))
                    value, grads = add_terms(loss, value, grads, current, aux)
                    opt.update_(train, grads, opt_state)
                    value = value.detach()
                else:
                    train, value = step(autograd_value_and_grad, train, frozen, batch, aux)
                if transform is not None:
                    with torch.no_grad():
                        transform(train)
                loss_sum += value.detach()
                count += 1
                last = value
            if last is None:
                return []
            totals.count[0] += count
            totals.last[0] = last.detach()
            if epoch_end is not None:
                current.update(epoch_end({k: current[k] for k in carry}))
            return [0]

        device = next(iter(params.values())).device
        totals = run_epochs(
            [self.client_id],
            device,
            plan.epochs,
            run_epoch,
            until=until,
            max_epochs=max_epochs,
            active=active,
            where=lambda k: self.where(stage),
        )
        carried = {k: current[k] for k in carry}
        out = {**frozen, **carried, **{k: v.detach() for k, v in train.items()}}
        return totals.fit({k: out[k] for k in params}, self.client_shape, until is not None)


def as_template(value: Any, template: Any) -> Any:
    """``value`` with the 0-dim tensors where ``template`` holds a Python number turned into one of
    its type (an upload's ``num_samples``, a state's flags written as numbers)."""
    if isinstance(value, Tensor) and value.dim() == 0 and isinstance(template, (bool, int, float)):
        return type(template)(value.item())
    if isinstance(value, dict) and isinstance(template, dict):
        return {key: as_template(v, template.get(key)) for key, v in value.items()}
    return value


def cached_prefix(
    model: UnitModel, units: Units, train: TrainSettings, data: DataSpec, start: int, trainable: Sequence[str]
) -> int:
    """``start`` where ``fit`` may compute units ``0..start-1`` once (see ``ClientContext.fit``), else 0."""
    if start <= 0:
        return 0
    lower = {name for _, names in units[:start] for name in names}
    below = sorted(lower & set(trainable))
    if below:
        raise ValueError(f"fit(start={start}) would train parameters of the units below it: {below}")
    if not (
        isinstance(data, TrainBatches)
        and not train.mixup
        and getattr(model, "prefix_is_deterministic", False)
        and getattr(model, "apply_units", None) is not None
        and not buffer_names(model)
    ):
        return 0
    return start


def from_unit(net: Net, start: int) -> Net:
    """``net`` on inputs that are already the output of units ``0..start-1``."""
    offset = start

    def shifted(
        params: Mapping[str, Tensor], x: Tensor, start: int = 0, stop: int | None = None, *, train: bool = True
    ) -> Tensor:
        return net(params, x, offset + start, stop, train=train)

    return shifted


@torch.no_grad()
def class_sums(
    net: Net, params: Params, fn: SampleMap, x: Tensor, y: Tensor, num_classes: int, batch_size: int
) -> Tensor:
    """Per true class, the sum of ``fn(net, params, x, y)`` over the samples (in evaluation batches)."""
    out: Tensor | None = None
    for start in range(0, len(y), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        values = fn(net, params, xb, yb)
        if out is None:
            out = values.new_zeros((num_classes, *values.shape[1:]))
        out.index_add_(0, yb, values)
    if out is None:
        raise ValueError("class_sums over a client without training samples")
    return out

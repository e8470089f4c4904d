"""One client's context: the reference implementation of ``ClientContext`` (plain loops, autograd).

Its batch orders, samples and losses are the ones every other context must reproduce: the
batched context draws the same (seed, round, client, purpose) streams and computes the same
losses on padded, masked batches.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from ..algorithms.context import (PER_CLIENT, DataSpec, EpochEnd, Fit, Metrics, PairedBatches, PerClient, Sample,
                                  SampleBatches, SampleMap, SplitBatches, StepFn, StopRule, TrainBatches, TrainSettings,
                                  Transform)
from ..data.federated import ClientData
from ..functional import Params, evaluate, torch_generator
from ..functional.training import (SGD, Batch, LossFn, Net, autograd_value_and_grad, check_finite, features_of,
                                  mix, net_of)
from ..models import UnitModel, Units, buffer_names, num_outputs
from .schedule import ClientSchedule, holdout_positions, sample_positions, split_halves


class SingleClientContext:
    """``ClientContext`` for one client (see ``pflkit.algorithms.context``)."""

    provides = frozenset({PER_CLIENT})
    client_shape: tuple[int, ...] = ()  # per-client values are plain numbers and tensors

    def __init__(self, client_id: int, round: int, seed: int, data: ClientData, model: UnitModel, units: Units,
                 train: TrainSettings, algorithm: str = "") -> None:
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

    # ---- who -------------------------------------------------------------------------------
    @property
    def client_ids(self) -> list[int]:
        return [self.client_id]

    @property
    def client_index(self) -> int:
        return self.client_id

    @property
    def num_train(self) -> int:
        return self.data.num_train

    @property
    def net(self) -> Net:
        return self._net

    def generator(self, purpose: str, k: int = 0) -> torch.Generator:
        """A fresh generator for (seed, round, client, purpose): the same draws on every engine."""
        return torch_generator(self.seed, "client", self.round, self.client_id, purpose)

    def where(self, stage: str) -> str:
        return f"algorithm {self.algorithm}, client {self.client_id}, round {self.round}, {stage}"

    # ---- data ------------------------------------------------------------------------------
    def batches(self, spec: TrainBatches = TrainBatches()) -> Iterator[Batch]:
        """The mini-batches of ``spec``, every epoch in turn."""
        for epoch in self._train_epochs(spec):
            yield from epoch

    def _train_epochs(self, spec: TrainBatches, open_ended: bool = False,
                      inputs: Tensor | None = None) -> Iterator[list[Batch]]:
        """The epochs of ``spec``; ``inputs`` replaces the training inputs row for row (features)."""
        x, y = (self.data.train_x if inputs is None else inputs), self.data.train_y
        schedule = ClientSchedule(spec, len(y), self.train.batch_size, self.seed, self.round, self.client_id,
                                  self.train.mixup, self.train.mixup_alpha)
        for _ in (itertools.count() if open_ended else range(spec.epochs)):
            epoch = schedule.next_epoch()
            batches = []
            for s, idx in enumerate(epoch.batches):
                idx = idx.to(x.device)
                if epoch.mixup is not None:
                    lam, perm = epoch.mixup[s]
                    batches.append(mix(x[idx], y[idx], lam, torch.as_tensor(perm, device=x.device)))
                else:
                    batches.append(Batch(x[idx], y[idx]))
            yield batches

    def _epochs(self, data: DataSpec, open_ended: bool, inputs: Tensor | None = None) -> Iterator[list[Any]]:
        if isinstance(data, TrainBatches):
            yield from self._train_epochs(data, open_ended, inputs)
        elif isinstance(data, PairedBatches):
            for epochs in zip(*(self._train_epochs(s) for s in data.streams)):
                yield list(zip(*epochs))
        elif isinstance(data, SplitBatches):
            for epoch in self._train_epochs(TrainBatches(data.purpose, data.epochs, 2 * self.train.batch_size)):
                pairs = []
                for batch in epoch:
                    h = split_halves(len(batch.y), self.train.batch_size)
                    first = Batch(batch.x[:h], batch.y[:h])
                    second = Batch(batch.x[h:], batch.y[h:]) if len(batch.y) > h else first
                    pairs.append((first, second))
                yield pairs
        elif isinstance(data, SampleBatches):
            s, b = data.sample, self.train.batch_size
            batches = [Batch(s.x[i:i + b], s.y[i:i + b]) for i in range(0, len(s.y), b)]
            while True:
                yield batches
                if not open_ended:
                    return
        else:
            raise TypeError(f"unknown data specification {data!r}")

    def sample(self, purpose: str, fraction: float, sampling: str = "random") -> Sample:
        x, y = self.data.train_x, self.data.train_y
        idx = sample_positions(len(y), fraction, sampling, self.generator(purpose)).to(x.device)
        return Sample(x[idx], y[idx])

    def holdout(self, fraction: float) -> Sample:
        rows = holdout_positions(self.data.num_train, fraction)
        return Sample(self.data.train_x[rows], self.data.train_y[rows])

    def differs(self, a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
        return not all(torch.equal(a[k], b[k]) for k in a if k in b)

    @property
    def label_counts(self) -> Tensor:
        return torch.bincount(self.data.train_y, minlength=self.num_classes)

    @torch.no_grad()
    def class_sums(self, params: Params, fn: SampleMap) -> Tensor:
        return class_sums(self.net, params, fn, self.data.train_x, self.data.train_y, self.num_classes,
                          self.train.eval_batch_size)

    @torch.no_grad()
    def features(self, params: Params, sample: Sample, stop: int) -> Sample:
        return sample.with_inputs(features_of(self.model, params, sample.x, stop))

    # ---- what the executor needs ------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, params: Params) -> list[dict[str, float]]:
        """The client's correct predictions, loss sum and test size (a list of one)."""
        return [evaluate(self.model, params, self.data.test_x, self.data.test_y, self.train.eval_batch_size)]

    @staticmethod
    def gather(values: list[Any]) -> Any:
        """The one client's value (a batched context stacks K of them)."""
        (value,) = values
        return value

    @staticmethod
    def split(value: Any, k: int, template: Any = None) -> Any:
        return value

    @staticmethod
    def split_metrics(metrics: Metrics, k: int) -> dict[str, Any]:
        """The client's metrics as Python values (0-dim tensors become numbers)."""
        return {key: v.item() if isinstance(v, Tensor) and v.dim() == 0 else v for key, v in metrics.items()}

    # ---- training --------------------------------------------------------------------------
    def fit(self, params: Params, loss: LossFn | None = None, *, step: StepFn | None = None,
            trainable: Sequence[str] | None = None, aux: Any = None, data: DataSpec = TrainBatches(),
            optimizer: SGD | None = None, transform: Transform | None = None, until: StopRule | None = None,
            max_epochs: int = 1, active: PerClient | None = None, carry: Sequence[str] = (),
            epoch_end: EpochEnd | None = None, stage: str = "local training", start: int = 0) -> Fit:
        if (loss is None) == (step is None):
            raise ValueError("fit takes either a loss or a step function")
        if active is not None and not bool(active):
            return Fit(dict(params), 0.0, 0, float("nan"), 0)
        start = cached_prefix(self.model, self.units, self.train, data, start, trainable or list(params))
        inputs = None
        if start:
            inputs = features_of(self.model, params, self.data.train_x, start)
        buffers = [k for k in buffer_names(self.model) if k in params]
        skip = set(buffers) | set(carry)
        names = [k for k in (params if trainable is None else trainable) if k not in skip]
        train = {k: params[k].detach().clone() for k in names}
        carried = {k: params[k].detach().clone() for k in carry}
        # training-mode forwards update batch-norm statistics in place: the caller's stay untouched
        stats = {k: params[k].detach().clone() for k in buffers}
        frozen = {**{k: v.detach() for k, v in params.items()
                     if k not in train and k not in stats and k not in carried}, **stats}
        net = self.net if not start else from_unit(self.net, start)
        if step is None:
            assert loss is not None
            opt = optimizer or self.train.optimizer()
            opt_state = opt.init(train)
            # the trained tensors are leaves updated in place: one dict of them serves every step
            leaves = [v.requires_grad_(True) for v in train.values()]
            current = {**frozen, **carried, **train}
        device = next(iter(params.values())).device
        loss_sum = torch.zeros((), device=device)
        count = 0
        epoch_losses: list[float] = []
        for epoch in self._epochs(data, open_ended=until is not None, inputs=inputs):
            last = None
            for batch in epoch:
                if step is None:
                    value = loss(net, current, batch, aux)
                    if carry:
                        value, updates = value
                        current.update({k: updates[k].detach() for k in carry})
                    grads = dict(zip(train, torch.autograd.grad(value, leaves)))
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
            check_finite(loss_sum, self.where(stage))
            if last is None:  # no data
                break
            if epoch_end is not None:
                current.update(epoch_end({k: current[k] for k in carry}))
            epoch_losses.append(float(last))
            if until is not None and (until(epoch_losses, self.client_id) or len(epoch_losses) >= max_epochs):
                break
        carried = {k: current[k] for k in carry} if step is None else carried
        out = {**frozen, **carried, **{k: v.detach() for k, v in train.items()}}
        return Fit({k: out[k] for k in params}, float(loss_sum) / max(count, 1), len(epoch_losses),
                   epoch_losses[-1] if epoch_losses else float("nan"), count,
                   epoch_losses if until is not None else None)


def cached_prefix(model: UnitModel, units: Units, train: TrainSettings, data: DataSpec, start: int,
                  trainable: Sequence[str]) -> int:
    """``start`` where ``fit`` may compute units ``0..start-1`` once (see ``ClientContext.fit``), else 0."""
    if start <= 0:
        return 0
    lower = {name for _, names in units[:start] for name in names}
    below = sorted(lower & set(trainable))
    if below:
        raise ValueError(f"fit(start={start}) would train parameters of the units below it: {below}")
    if not (isinstance(data, TrainBatches) and not train.mixup and getattr(model, "prefix_is_deterministic", False)
            and getattr(model, "apply_units", None) is not None and not buffer_names(model)):
        return 0
    return start


def from_unit(net: Net, start: int) -> Net:
    """``net`` on inputs that are already the output of units ``0..start-1``."""
    def shifted(params: Mapping[str, Tensor], x: Tensor, first: int = 0, stop: int | None = None, *,
                train: bool = True) -> Tensor:
        return net(params, x, start + first, stop, train=train)
    return shifted


@torch.no_grad()
def class_sums(net: Net, params: Params, fn: SampleMap, x: Tensor, y: Tensor, num_classes: int,
               batch_size: int) -> Tensor:
    """Per true class, the sum of ``fn(net, params, x, y)`` over the samples (in evaluation batches)."""
    out: Tensor | None = None
    for start in range(0, len(y), batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        values = fn(net, params, xb, yb)
        if out is None:
            out = values.new_zeros((num_classes, *values.shape[1:]))
        out.index_add_(0, yb, values)
    if out is None:
        raise ValueError("class_sums over a client without training samples")
    return out

"""K clients at once: the batched implementation of ``ClientContext`` (made for GPUs).

Every tensor of the payload and the state carries a leading client dimension; ``fit`` runs the
algorithm's loss or step function under ``torch.func.vmap``. Clients take different numbers of
steps: at step s of an epoch, the clients that still have a batch are, sorted by their step
counts, a prefix of the running set, so each step computes that prefix only (no padding work
for finished clients). The only padding is inside the batch of a client with fewer samples than
one batch (masked: losses average over real samples). Clients that stop early (``until``) or
are inactive leave the running set. Every client draws the same (seed, round, client, purpose)
streams as in ``SingleClientContext``, so results agree up to float reassociation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.func import grad_and_value, vmap
from torch.nn import functional as F
from torch.utils._pytree import tree_map

from ..algorithms.context import (DataSpec, EpochEnd, Fit, Metrics, PairedBatches, PerClient, Sample, SampleBatches,
                                  SampleMap, SplitBatches, StepFn, StopRule, TrainBatches, TrainSettings, Transform)
from ..data.federated import ClientData, FederatedData
from ..functional import Params, torch_generator
from ..functional.training import (SGD, Batch, LossFn, Net, NonFiniteLossError, features_of, forward, mix, net_of,
                                  prediction_logits)
from ..models import UnitModel, Units, buffer_names, num_outputs
from .client import cached_prefix, class_sums, from_unit
from .schedule import ClientSchedule, holdout_positions, sample_positions
from .stacking import stack, unstack

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    """Say once per process that a batched context runs a step client by client."""
    if message not in _logged:
        _logged.add(message)
        log.info("batched context: %s", message)


@dataclass
class _Schedule:
    """One epoch of one data stream for all K clients: dataset rows [K, S, b], their mask and
    the number of steps of each client [K]; with mixup each batch's lam [K, S] and partner
    positions [K, S, b]."""

    rows: Tensor
    mask: Tensor
    steps: Tensor
    lam: Tensor | None = None
    perm: Tensor | None = None


class BatchedClientContext:
    """``ClientContext`` for K clients at once (see the module docstring)."""

    provides: frozenset[str] = frozenset()

    def __init__(self, client_ids: list[int], round: int, seed: int, data: FederatedData, model: UnitModel,
                 units: Units, train: TrainSettings, algorithm: str = "") -> None:
        if data.x is None or data.y is None:
            raise ValueError("a batched context needs FederatedData with the dataset tensors (x, y)")
        self._ids = list(client_ids)
        self.round = round
        self.seed = seed
        self.fed = data
        self.model = model
        self.units = units
        self.train = train.at_round(round)  # the round's learning rate (lr_decay)
        self.algorithm = algorithm
        self.clients: list[ClientData] = [data.client(i) for i in client_ids]
        self.device = data.x.device
        self.num_classes = num_outputs(model)
        self._net = net_of(model)
        self._cpu_rows: list[Tensor] | None = None

    # ---- who -------------------------------------------------------------------------------
    @property
    def client_ids(self) -> list[int]:
        return self._ids

    @property
    def client_shape(self) -> tuple[int, ...]:
        """Per-client values carry this leading dimension: [K, ...]."""
        return (len(self._ids),)

    @property
    def client_index(self) -> Tensor:
        return torch.tensor(self._ids, device=self.device)

    @property
    def num_train(self) -> Tensor:
        return torch.tensor([c.num_train for c in self.clients], device=self.device)

    @property
    def net(self) -> Net:
        return self._net

    def generator(self, purpose: str, k: int) -> torch.Generator:
        return torch_generator(self.seed, "client", self.round, self._ids[k], purpose)

    def where(self, stage: str, k: int | None = None) -> str:
        who = f"client {self._ids[k]}" if k is not None else f"clients {self._ids}"
        return f"algorithm {self.algorithm}, {who}, round {self.round}, {stage}"

    @property
    def label_counts(self) -> Tensor:
        return torch.stack([torch.bincount(c.train_y, minlength=self.num_classes) for c in self.clients])

    @torch.no_grad()
    def class_sums(self, params: Params, fn: SampleMap) -> Tensor:
        # each client's pass is a few large evaluation batches: vmapping them would pad every client
        # to the largest one for little gain
        _log_once("class_sums run client by client (a few large batches each)")
        return torch.stack([class_sums(self._net, {k: v[i] for k, v in params.items()}, fn, c.train_x, c.train_y,
                                       self.num_classes, self.train.eval_batch_size)
                            for i, c in enumerate(self.clients)])

    # ---- tensors ---------------------------------------------------------------------------
    def differs(self, a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tensor:
        out = torch.zeros(len(self._ids), dtype=torch.bool, device=self.device)
        for k in a:
            if k in b:
                out |= (a[k] != b[k]).flatten(1).any(1)
        return out

    @torch.no_grad()
    def features(self, params: Params, sample: Sample, stop: int) -> Sample:
        assert sample.lengths is not None
        lengths = sample.lengths.tolist()
        if sample.x.device.type == "cpu":
            # vmapped convolutions become grouped convolutions, slow on CPU: one large batch per client
            _log_once("features on CPU run client by client (vmapped convolutions are slow on CPU)")
            parts = [features_of(self.model, {k: v[i] for k, v in params.items()}, sample.x[i, :n], stop)
                     for i, n in enumerate(lengths)]
            out = parts[0].new_zeros((len(parts), sample.x.shape[1], *parts[0].shape[1:]))
            for i, part in enumerate(parts):
                out[i, :len(part)] = part
            return sample.with_inputs(out)
        run = vmap(lambda p, xb: forward(self.model, p, xb, stop=stop, train=True))
        per_step = max(1, self.train.eval_batch_size // max(len(lengths), 1))
        x = sample.x
        return sample.with_inputs(torch.cat([run(params, x[:, i:i + per_step]) for i in range(0, x.shape[1], per_step)],
                                            dim=1))

    def holdout(self, fraction: float) -> Sample:
        return self._padded([c.train_rows[holdout_positions(c.num_train, fraction)] for c in self.clients])

    def _padded(self, rows: list[Tensor]) -> Sample:
        """The samples at dataset ``rows`` of each client, padded to [K, n_max] with their lengths."""
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        padded = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long, device=self.device)
        for i, r in enumerate(rows):
            padded[i, :len(r)] = r
        return Sample(self.fed.x[padded], self.fed.y[padded], lengths)

    def sample(self, purpose: str, fraction: float, sampling: str = "random") -> Sample:
        return self._padded([c.train_rows[sample_positions(c.num_train, fraction, sampling, self.generator(purpose, k))
                                          .to(self.device)] for k, c in enumerate(self.clients)])

    @torch.no_grad()
    def evaluate(self, params: Params) -> list[dict[str, float]]:
        """Correct predictions, loss sum and test size of every client, vmapped over clients."""
        K = len(self.clients)
        sizes = [c.num_test for c in self.clients]
        T = max(sizes) if sizes else 0
        rows = torch.zeros(K, max(T, 1), dtype=torch.long, device=self.device)
        mask = torch.zeros(K, max(T, 1), dtype=torch.bool, device=self.device)
        for k, c in enumerate(self.clients):
            rows[k, :c.num_test] = c.test_rows
            mask[k, :c.num_test] = True
        correct = torch.zeros(K, device=self.device)
        loss = torch.zeros(K, device=self.device)
        per_step = max(1, self.train.eval_batch_size // max(K, 1))
        run = vmap(lambda p, x: forward(self.model, p, x, train=False))
        for start in range(0, T, per_step):
            r, m = rows[:, start:start + per_step], mask[:, start:start + per_step]
            logits = prediction_logits(self.model, params, self.fed.x[r], run)
            y = self.fed.y[r]
            correct += ((logits.argmax(-1) == y) & m).sum(1)
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(m)
            loss += (ce * m).sum(1)
        return [{"correct": int(correct[k]), "loss_sum": float(loss[k]), "num_samples": sizes[k]} for k in range(K)]

    def gather(self, values: list[Any]) -> Any:
        """The clients' values stacked to [K, ...] on this context's device (see ``stacking``)."""
        return stack(values, self.device)

    @staticmethod
    def split(value: Any, k: int, template: Any = None) -> Any:
        """Client ``k``'s own copy of a stacked value; Python scalars follow ``template``."""
        return unstack(value, k, template)

    @staticmethod
    def split_metrics(metrics: Metrics, k: int) -> dict[str, Any]:
        return {key: item(v, k) for key, v in metrics.items()}

    # ---- data schedules ----------------------------------------------------------------------
    def _train_schedule(self, schedules: list[ClientSchedule]) -> _Schedule:
        """The next epoch of every client's schedule as row tables."""
        epochs = [schedule.next_epoch() for schedule in schedules]
        b = max(schedule.batch_size for schedule in schedules)
        steps = torch.tensor([len(e.batches) for e in epochs])
        S = max(int(steps.max()), 1)
        K = len(epochs)
        rows = torch.zeros(K, S, b, dtype=torch.long)
        mask = torch.zeros(K, S, b)
        mixing = epochs[0].mixup is not None
        lam = torch.ones(K, S) if mixing else None
        perm = torch.arange(b).repeat(K, S, 1) if mixing else None
        for k, (epoch, train_rows) in enumerate(zip(epochs, self._cpu_train_rows())):
            for s, idx in enumerate(epoch.batches):
                rows[k, s, :len(idx)] = train_rows[idx]
                mask[k, s, :len(idx)] = 1.0
                if epoch.mixup is not None:
                    lam[k, s], partners = epoch.mixup[s]  # type: ignore[index]
                    perm[k, s, :len(idx)] = torch.as_tensor(partners)  # type: ignore[index]
        to = (lambda t: t.to(self.device) if t is not None else None)  # noqa: E731
        return _Schedule(to(rows), to(mask), steps, to(lam), to(perm))

    def _cpu_train_rows(self) -> list[Tensor]:
        """Each client's dataset rows on the CPU (copied once per context, not once per epoch)."""
        if self._cpu_rows is None:
            self._cpu_rows = [c.train_rows.cpu() for c in self.clients]
        return self._cpu_rows

    @torch.no_grad()
    def _prefix_outputs(self, params: Params, start: int) -> tuple[Tensor, Tensor]:
        """Units ``0..start-1`` over every client's training rows, each on its own parameters:
        (outputs stacked client after client, the position of each dataset row in them)."""
        outputs = [features_of(self.model, {name: value[k] for name, value in params.items()}, self.fed.x[c.train_rows],
                               start) for k, c in enumerate(self.clients)]
        position = torch.zeros(len(self.fed.x), dtype=torch.long, device=self.device)  # padding rows: any real one
        offset = 0
        for c in self.clients:
            position[c.train_rows] = torch.arange(offset, offset + c.num_train, device=self.device)
            offset += c.num_train
        return torch.cat(outputs), position

    def _plan(self, data: DataSpec) -> "_Plan":
        if isinstance(data, SampleBatches):
            return _SamplePlan(data.sample, self.train.batch_size)
        if isinstance(data, TrainBatches):
            return _TrainPlan(self, data)
        if isinstance(data, SplitBatches):
            return _SplitPlan(self, data)
        if isinstance(data, PairedBatches):
            return _PairedPlan([self._plan(s) for s in data.streams])
        raise TypeError(f"unknown data specification {data!r}")

    # ---- training --------------------------------------------------------------------------
    def fit(self, params: Params, loss: LossFn | None = None, *, step: StepFn | None = None,
            trainable: Sequence[str] | None = None, aux: Any = None, data: DataSpec = TrainBatches(),
            optimizer: SGD | None = None, transform: Transform | None = None, until: StopRule | None = None,
            max_epochs: int = 1, active: PerClient | None = None, carry: Sequence[str] = (),
            epoch_end: EpochEnd | None = None, stage: str = "local training", start: int = 0) -> Fit:
        if (loss is None) == (step is None):
            raise ValueError("fit takes either a loss or a step function")
        start = cached_prefix(self.model, self.units, self.train, data, start, trainable or list(params))
        if [k for k in buffer_names(self.model) if k in params]:
            raise NotImplementedError(f"batched training does not support models with buffers (batch norm: "
                                      f"{type(self.model).__name__}); engines run them client by client")
        K = len(self.clients)
        names = [k for k in (list(params) if trainable is None else list(trainable)) if k not in set(carry)]
        train = {k: params[k].detach().clone() for k in names}
        carried = {k: params[k].detach().clone() for k in carry}
        frozen = {k: v.detach() for k, v in params.items() if k not in train and k not in carried}
        net = self._net if not start else from_unit(self._net, start)
        opt = optimizer or self.train.optimizer()
        opt_state = opt.init(train) if step is None else {}
        if step is None:
            assert loss is not None

            def objective(tp: Params, fz: Params, b: Any, a: Any) -> tuple[Tensor, Params]:
                out = loss(net, {**fz, **tp}, b, a)
                return out if carry else (out, {})
            batched = _vmapped(grad_and_value(objective, has_aux=True), aux)
        elif getattr(step, "batch_polymorphic", False):
            batched = partial(step, None)
        else:
            batched = _vmapped(lambda tp, fz, b, a: step(grad_and_value, tp, fz, b, a), aux)
        plan = self._plan(data) if not start else _TrainPlan(self, data, self._prefix_outputs(params, start))  # type: ignore[arg-type]
        loss_sum = torch.zeros(K, device=self.device)
        count = torch.zeros(K, device=self.device)
        last = torch.full((K,), math.nan, device=self.device)
        epochs = torch.zeros(K, dtype=torch.long)
        history: list[list[float]] = [[] for _ in range(K)]
        running = list(range(K)) if active is None else torch.nonzero(torch.as_tensor(active)).flatten().tolist()
        fixed = plan.fixed_epochs() if until is None else max_epochs
        epoch = 0
        while running and epoch < fixed:
            steps = plan.steps(epoch)
            running = sorted(running, key=lambda k: -int(steps[k]))  # steps decrease: each step runs a prefix
            whole = running == list(range(K))
            idx = torch.tensor(running, device=self.device)
            pick = (lambda t: t) if whole else (lambda t: t[idx])
            sub_train = {k: pick(v) for k, v in train.items()}
            sub_carried = {k: pick(v) for k, v in carried.items()}
            sub_frozen = {k: pick(v) for k, v in frozen.items()}
            sub_state = {k: pick(v) for k, v in opt_state.items()}
            sub_aux = tree_map(pick, aux) if aux is not None else None
            sub_steps = steps[torch.tensor(running)]
            for s in range(int(sub_steps.max()) if len(running) else 0):
                n = int((sub_steps > s).sum())
                batch = plan.batch(epoch, s, slice(0, n) if whole else idx[:n])
                head = {k: v[:n] for k, v in sub_frozen.items()}
                head.update({k: v[:n] for k, v in sub_carried.items()})
                prefix_aux = tree_map(lambda t: t[:n], sub_aux) if sub_aux is not None else None
                if step is None:
                    grads, (values, updates) = batched({k: v[:n] for k, v in sub_train.items()}, head, batch,
                                                       prefix_aux)
                    opt.update_(sub_train, grads, sub_state, rows=slice(0, n))
                    with torch.no_grad():
                        for k in carry:
                            sub_carried[k][:n] = updates[k].detach()
                else:
                    new, values = batched({k: v[:n] for k, v in sub_train.items()}, head, batch, prefix_aux)
                    with torch.no_grad():
                        for k in sub_train:
                            sub_train[k][:n] = new[k]
                if transform is not None:
                    with torch.no_grad():
                        transform({k: v[:n] for k, v in sub_train.items()})
                with torch.no_grad():
                    loss_sum[idx[:n]] += values.detach()
                    count[idx[:n]] += 1
                    last[idx[:n]] = values.detach()
            if epoch_end is not None and carry:
                with torch.no_grad():
                    sub_carried.update(epoch_end(dict(sub_carried)))
            with torch.no_grad():
                for k in carried:
                    if sub_carried[k] is not carried[k]:  # (the whole set shares the tensor itself)
                        carried[k][idx] = sub_carried[k]
                if not whole:
                    for k in train:
                        train[k][idx] = sub_train[k]
                    for k in opt_state:
                        opt_state[k][idx] = sub_state[k]
            bad = (~torch.isfinite(loss_sum[idx])).nonzero().flatten()
            if len(bad):
                k = running[int(bad[0])]
                raise NonFiniteLossError(f"training loss became {float(loss_sum[k])} ({self.where(stage, k)}); "
                                         "lower the learning rate or check the data for NaN/inf values")
            ran = [k for k in running if int(steps[k]) > 0]
            epochs[torch.tensor(ran, dtype=torch.long)] += 1
            if until is not None:
                values = last[torch.tensor(ran, device=self.device)].tolist() if ran else []
                for k, value in zip(ran, values):
                    history[k].append(value)
                running = [k for k in ran if not (until(history[k], self._ids[k]) or len(history[k]) >= max_epochs)]
            epoch += 1
        out = {**frozen, **carried, **train}
        return Fit({k: out[k] for k in params}, loss_sum / count.clamp(min=1), epochs.to(self.device), last,
                   count.to(torch.long), history if until is not None else None)


def _vmapped(fn: Callable[..., Any], aux: Any) -> Callable[..., Any]:
    """``fn(trainable, frozen, batch, aux)`` vmapped over the clients (``aux`` None: not mapped;
    a batch's absent fields, e.g. no mixup, are not mapped either)."""
    def call(trainable: Params, frozen: Params, batch: Any, aux_values: Any) -> Any:
        dims = (0, 0, _batch_dims(batch), None if aux_values is None else 0)
        return vmap(fn, in_dims=dims)(trainable, frozen, batch, aux_values)
    return call


def _batch_dims(batch: Any) -> Any:
    if isinstance(batch, Batch):
        return Batch(*(None if field is None else 0 for field in batch))
    return tuple(_batch_dims(b) for b in batch)


class _Plan:
    """How a data specification becomes per-client step counts and batches, epoch by epoch."""

    def fixed_epochs(self) -> int:
        raise NotImplementedError

    def steps(self, epoch: int) -> Tensor:
        raise NotImplementedError

    def batch(self, epoch: int, step: int, clients: Tensor | slice) -> Any:
        raise NotImplementedError


class _TrainPlan(_Plan):
    def __init__(self, ctx: BatchedClientContext, spec: TrainBatches,
                 inputs: tuple[Tensor, Tensor] | None = None) -> None:
        """``inputs``: (features, position of each dataset row in them) replacing the dataset's inputs."""
        self.ctx, self.spec, self.inputs = ctx, spec, inputs
        # one schedule per client for all epochs, drawn in order (the per-client context's draws)
        train = ctx.train
        self.clients = [ClientSchedule(spec, c.num_train, train.batch_size, ctx.seed, ctx.round, i, train.mixup,
                                       train.mixup_alpha) for i, c in zip(ctx.client_ids, ctx.clients)]
        self.schedules: list[_Schedule] = []

    def fixed_epochs(self) -> int:
        return self.spec.epochs

    def schedule(self, epoch: int) -> _Schedule:
        while len(self.schedules) <= epoch:  # epochs are drawn in order from the generators
            self.schedules.append(self.ctx._train_schedule(self.clients))
        return self.schedules[epoch]

    def steps(self, epoch: int) -> Tensor:
        return self.schedule(epoch).steps

    def batch(self, epoch: int, step: int, clients: Tensor | slice) -> Batch:
        s = self.schedule(epoch)
        rows = s.rows[clients, step]
        x = self.ctx.fed.x[rows] if self.inputs is None else self.inputs[0][self.inputs[1][rows]]
        y, mask = self.ctx.fed.y[rows], s.mask[clients, step]
        if s.lam is None or s.perm is None:
            return Batch(x, y, mask)
        return mix(x, y, s.lam[clients, step], s.perm[clients, step])._replace(mask=mask)


class _SplitPlan(_TrainPlan):
    """Batches of 2b, each split into (B, B') by masks (see ``SplitBatches``)."""

    def __init__(self, ctx: BatchedClientContext, spec: SplitBatches) -> None:
        super().__init__(ctx, TrainBatches(spec.purpose, spec.epochs, 2 * ctx.train.batch_size))

    def batch(self, epoch: int, step: int, clients: Tensor | slice) -> tuple[Batch, Batch]:
        whole = super().batch(epoch, step, clients)
        m = whole.mask
        real = m.sum(1, keepdim=True)
        h = torch.div(real + 1, 2, rounding_mode="floor").clamp(max=self.ctx.train.batch_size)
        position = torch.arange(m.shape[1], device=m.device)[None, :].to(m.dtype)
        first = m * (position < h)
        second = torch.where(real > h, m * (position >= h), first)
        return Batch(whole.x, whole.y, first), Batch(whole.x, whole.y, second)


class _PairedPlan(_Plan):
    def __init__(self, plans: list[_Plan]) -> None:
        self.plans = plans

    def fixed_epochs(self) -> int:
        return min(p.fixed_epochs() for p in self.plans)

    def steps(self, epoch: int) -> Tensor:
        return torch.stack([p.steps(epoch) for p in self.plans]).min(0).values

    def batch(self, epoch: int, step: int, clients: Tensor | slice) -> tuple[Any, ...]:
        return tuple(p.batch(epoch, step, clients) for p in self.plans)


class _SamplePlan(_Plan):
    def __init__(self, sample: Sample, batch_size: int) -> None:
        assert sample.lengths is not None
        self.sample, self.b = sample, batch_size
        self.counts = (sample.lengths.cpu() + batch_size - 1) // batch_size
        positions = torch.arange(sample.y.shape[1], device=sample.lengths.device)
        self.mask = (positions[None, :] < sample.lengths[:, None]).to(sample.x.dtype)

    def fixed_epochs(self) -> int:
        return 1

    def steps(self, epoch: int) -> Tensor:
        return self.counts

    def batch(self, epoch: int, step: int, clients: Tensor | slice) -> Batch:
        cols = slice(step * self.b, (step + 1) * self.b)
        return Batch(self.sample.x[clients, cols], self.sample.y[clients, cols], self.mask[clients, cols])


# ---- running a round's jobs in chunks of batched contexts ------------------------------------
def batching_blocker(algorithm: Any, model: UnitModel, data: FederatedData) -> str | None:
    """Why ``algorithm``'s clients cannot share a batched context here, or None if they can."""
    missing = set(algorithm.needs) - BatchedClientContext.provides
    if missing:
        return f"{algorithm.name} needs {', '.join(sorted(missing))} client code"
    if buffer_names(model):
        return (f"{type(model).__name__} has buffers (batch-norm running statistics, updated in place by "
                "training-mode forwards, which vmap does not support)")
    if data.x is None:
        return "the data holds no dataset tensors to gather batches from"
    return None


def size_order(data: FederatedData, client_ids: Sequence[int]) -> list[int]:
    """Positions of ``client_ids`` by training-set size, largest first (step counts decrease)."""
    return sorted(range(len(client_ids)), key=lambda j: -data.client(client_ids[j]).num_train)


def item(value: Any, k: int) -> Any:
    """Client ``k``'s entry of a per-client metric."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.dim() == 0 else value[k].item()
    if isinstance(value, (list, tuple)):
        return value[k]
    return value

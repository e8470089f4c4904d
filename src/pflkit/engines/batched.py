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
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.func import grad_and_value, vmap
from torch.nn import functional as F
from torch.utils._pytree import tree_map

from ..algorithms.context import (
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
from ..data.federated import ClientData, FederatedData
from ..functional import Params, torch_generator
from ..functional.training import (
    SGD,
    Batch,
    CarryLossFn,
    ClosedFormTerm,
    Ensemble,
    LossFn,
    Net,
    add_terms,
    base_loss,
    features_of,
    forward,
    net_of,
    prediction_logits,
)
from ..models import UnitModel, Units, num_outputs, statistic_entries
from .client import cached_prefix, class_sums, from_unit
from .fitting import FitTotals, check_cancel, check_fit_arguments, loss_value, run_epochs
from .graphs import Recorder, StepGraphs
from .plan import ClientPlan, EpochTable
from .schedule import holdout_positions, sample_positions
from .stacking import stack, unstack

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _rows(rows: Tensor | None) -> Tensor:
    """A client's rows of the dataset tensors (``FederatedData.build`` gives every client its rows)."""
    assert rows is not None
    return rows


def _log_once(message: str) -> None:
    """Say once per process that a batched context runs a step client by client."""
    if message not in _logged:
        _logged.add(message)
        log.info("batched context: %s", message)


class BatchedClientContext:
    """``ClientContext`` for K clients at once (see the module docstring)."""

    provides: frozenset[str] = frozenset()

    def __init__(
        self,
        client_ids: list[int],
        round: int,
        seed: int,
        data: FederatedData,
        model: UnitModel,
        units: Units,
        train: TrainSettings,
        algorithm: str = "",
        cancel: threading.Event | None = None,
        graphs: Callable[[torch.device], Recorder] | None = None,
    ) -> None:
        """``cancel``: once set, training stops at its next step (JobsAbandoned); ``graphs``: the
        recorder of each epoch's steps (``CudaGraphRecorder``: replay them as CUDA graphs), None:
        every step eager."""
        self.cancel = cancel
        self.graphs = graphs
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
        self.work: dict[int, float] = {}  # client id -> share of its planned steps it takes (stragglers)
        #: steps taken eagerly, captured and replayed as CUDA graphs, summed over this context's fits
        self.graph_counts: dict[str, int] = {"eager": 0, "captured": 0, "replayed": 0}

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

    def generator(self, purpose: str, k: int = 0) -> torch.Generator:
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
        return torch.stack(
            [
                class_sums(
                    self._net,
                    {k: v[i] for k, v in params.items()},
                    fn,
                    c.train_x,
                    c.train_y,
                    self.num_classes,
                    self.train.eval_batch_size,
                )
                for i, c in enumerate(self.clients)
            ]
        )

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
            parts = [
                features_of(self.model, {k: v[i] for k, v in params.items()}, sample.x[i, :n], stop)
                for i, n in enumerate(lengths)
            ]
            out = parts[0].new_zeros((len(parts), sample.x.shape[1], *parts[0].shape[1:]))
            for i, part in enumerate(parts):
                out[i, : len(part)] = part
            return sample.with_inputs(out)
        run = vmap(lambda p, xb: forward(self.model, p, xb, stop=stop, train=True))
        per_step = max(1, self.train.eval_batch_size // max(len(lengths), 1))
        x = sample.x
        return sample.with_inputs(
            torch.cat([run(params, x[:, i : i + per_step]) for i in range(0, x.shape[1], per_step)], dim=1)
        )

    def holdout(self, fraction: float) -> Sample:
        return self._padded([_rows(c.train_rows)[holdout_positions(c.num_train, fraction)] for c in self.clients])

    def _padded(self, rows: list[Tensor]) -> Sample:
        """The samples at dataset ``rows`` of each client, padded to [K, n_max] with their lengths."""
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        padded = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long, device=self.device)
        for i, r in enumerate(rows):
            padded[i, : len(r)] = r
        assert self.fed.x is not None and self.fed.y is not None
        return Sample(self.fed.x[padded], self.fed.y[padded], lengths)

    def sample(self, purpose: str, fraction: float, sampling: str = "random") -> Sample:
        return self._padded(
            [
                _rows(c.train_rows)[
                    sample_positions(c.num_train, fraction, sampling, self.generator(purpose, k)).to(self.device)
                ]
                for k, c in enumerate(self.clients)
            ]
        )

    @torch.no_grad()
    def evaluate(self, params: Params | Ensemble) -> list[dict[str, float]]:
        """Correct predictions, loss sum and test size of every client, vmapped over clients."""
        K = len(self.clients)
        sizes = [c.num_test for c in self.clients]
        T = max(sizes) if sizes else 0
        rows = torch.zeros(K, max(T, 1), dtype=torch.long, device=self.device)
        mask = torch.zeros(K, max(T, 1), dtype=torch.bool, device=self.device)
        for k, c in enumerate(self.clients):
            rows[k, : c.num_test] = _rows(c.test_rows)
            mask[k, : c.num_test] = True
        correct = torch.zeros(K, device=self.device)
        loss = torch.zeros(K, device=self.device)
        per_step = max(1, self.train.eval_batch_size // max(K, 1))
        run = vmap(lambda p, x: forward(self.model, p, x, train=False))
        assert self.fed.x is not None and self.fed.y is not None
        for start in range(0, T, per_step):
            r, m = rows[:, start : start + per_step], mask[:, start : start + per_step]
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

    # ---- data plans ------------------------------------------------------------------------
    def _cpu_train_rows(self) -> list[Tensor]:
        """Each client's dataset rows on the CPU (copied once per context, not once per epoch)."""
        if self._cpu_rows is None:
            self._cpu_rows = [_rows(c.train_rows).cpu() for c in self.clients]
        return self._cpu_rows

    @torch.no_grad()
    def _prefix_outputs(self, params: Params, start: int) -> tuple[Tensor, list[int]]:
        """Units ``0..start-1`` over every client's training data, each on its own parameters:
        the outputs stacked client after client, and where each client's begin."""
        assert self.fed.x is not None
        outputs = [
            features_of(self.model, {name: value[k] for name, value in params.items()}, self.fed.x[c.train_rows], start)
            for k, c in enumerate(self.clients)
        ]
        offsets = [0]
        for c in self.clients[:-1]:
            offsets.append(offsets[-1] + c.num_train)
        return torch.cat(outputs), offsets

    def _source(
        self, params: Params, data: DataSpec, start: int
    ) -> tuple[Tensor, Tensor, Callable[[int, Tensor], Tensor]]:
        """The flat (x, y) the fit's batches are gathered from, and how a client's positions map to its rows."""
        if isinstance(data, SampleBatches):
            sample = data.sample
            width = sample.y.shape[1]
            return sample.x.flatten(0, 1), sample.y.flatten(0, 1), lambda k, p: p + k * width
        assert self.fed.x is not None and self.fed.y is not None
        if start:
            x, offsets = self._prefix_outputs(params, start)
            return x, torch.cat([self.fed.y[c.train_rows] for c in self.clients]), lambda k, p: p + offsets[k]
        rows = self._cpu_train_rows()
        return self.fed.x, self.fed.y, lambda k, p: rows[k][p]

    def _plans(self, data: DataSpec) -> list[ClientPlan]:
        lengths: list[int | None] = [None] * len(self.clients)
        if isinstance(data, SampleBatches):
            assert data.sample.lengths is not None  # (a batched context's samples: [K, n_max] and their lengths)
            lengths = data.sample.lengths.tolist()
        return [
            ClientPlan(data, c.num_train, self.train, self.seed, self.round, i, n, self.work.get(i, 1.0))
            for i, c, n in zip(self._ids, self.clients, lengths)
        ]

    # ---- training --------------------------------------------------------------------------
    def _step_graphs(self, stage: str, step: StepFn | None, transform: Transform | None) -> StepGraphs | None:
        """An epoch's step graphs, or None where its steps run eagerly: no recorder, or a step
        function or transform of the algorithm's own (Python code a graph would not re-run)."""
        if self.graphs is None:
            return None
        if step is not None or transform is not None:
            _log_once(f"{self.algorithm}'s {stage} has its own step or transform: its steps run without CUDA graphs")
            return None
        return StepGraphs(self.graphs(self.device), self.device, self.where(stage))

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
        # batch norm's training-mode forwards update the running statistics in place, client by
        # client under vmap (each client's rows of the stacked statistics): the caller's stay untouched
        buffers = statistic_entries(self.model, params)
        if buffers and vectorized:
            raise NotImplementedError(
                f"a vectorized step cannot train {type(self.model).__name__}: its batch norm needs each "
                "client's forward under vmap"
            )
        skip = set(carry) | set(buffers)
        names = [k for k in (list(params) if trainable is None else list(trainable)) if k not in skip]
        train = {k: params[k].detach().clone() for k in names}
        carried = {k: params[k].detach().clone() for k in carry}
        frozen = {
            k: v.detach().clone() if k in buffers else v.detach()
            for k, v in params.items()
            if k not in train and k not in carried
        }
        net = self._net if not start else from_unit(self._net, start)
        opt = optimizer or self.train.optimizer()
        opt_state = opt.init(train) if step is None else {}
        if step is None:
            assert loss is not None

            def objective(tp: Params, fz: Params, b: Any, a: Any) -> tuple[Tensor, Params]:
                return loss_value(base_loss(loss), net, {**fz, **tp}, b, a, carry)

            batched = _vmapped(grad_and_value(objective, has_aux=True), aux)
        elif vectorized:
            batched = partial(step, None)
        else:
            batched = _vmapped(lambda tp, fz, b, a: step(grad_and_value, tp, fz, b, a), aux)
        x, y, to_rows = self._source(params, data, start)
        plans = self._plans(data)
        K = len(self.clients)

        fixed_table: list[EpochTable] = []  # a fixed sample's batches are the same every epoch: built once

        def run_epoch(epoch: int, running: list[int], totals: FitTotals) -> list[int]:
            if fixed_table:
                table = fixed_table[0]
            else:
                table = EpochTable.build([p.next_epoch() for p in plans], to_rows, self.device)
                if isinstance(data, SampleBatches):
                    fixed_table.append(table)
            steps = table.steps
            if buffers:
                check_full_batches(table, self.model)
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

            def take_step(s: int | Tensor, n: int) -> None:
                """Step ``s`` of the first ``n`` running clients, every result written in place."""
                batch = table.batch(x, y, s, slice(0, n) if whole else idx[:n])
                head = {k: v[:n] for k, v in sub_frozen.items()}
                head.update({k: v[:n] for k, v in sub_carried.items()})
                prefix_aux = tree_map(lambda t, n=n: t[:n], sub_aux) if sub_aux is not None else None
                if step is None:
                    running_train = {k: v[:n] for k, v in sub_train.items()}
                    grads, (values, updates) = batched(running_train, head, batch, prefix_aux)
                    values, grads = add_terms(
                        loss,
                        values,
                        grads,
                        {**head, **running_train},
                        prefix_aux,
                        partial(_add_term_value, train=running_train, frozen=head, aux=prefix_aux),
                    )
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
                    totals.loss_sum[idx[:n]] += values.detach()
                    totals.count[idx[:n]] += 1
                    totals.last[idx[:n]] = values.detach()

            graphs = self._step_graphs(stage, step, transform)
            for s in range(int(sub_steps.max()) if len(running) else 0):
                check_cancel(self.cancel, self.where(stage))
                n = int((sub_steps > s).sum())
                if graphs is None:
                    take_step(s, n)
                else:
                    graphs.run(n, s, int(sub_steps[n - 1]) - s, partial(take_step, graphs.step_index, n))
            if graphs is not None:
                for key, count in graphs.counts.items():
                    self.graph_counts[key] += count
            ran = [k for k in running if int(steps[k]) > 0]
            with torch.no_grad():
                if epoch_end is not None and ran:
                    stepped = int((sub_steps > 0).sum())  # the running clients that took a step: a prefix
                    mapped = epoch_end({k: v[:stepped] for k, v in sub_carried.items()})
                    # copies first: a returned view of another carried entry would change mid-write
                    mapped = {k: mapped[k].clone() for k in carry}
                    for k in carry:
                        sub_carried[k][:stepped] = mapped[k]
                for k in carried:
                    if sub_carried[k] is not carried[k]:  # (the whole set shares the tensor itself)
                        carried[k][idx] = sub_carried[k]
                if not whole:
                    for k in train:
                        train[k][idx] = sub_train[k]
                    for k in buffers:
                        frozen[k][idx] = sub_frozen[k]
                    for k in opt_state:
                        opt_state[k][idx] = sub_state[k]
            return ran

        totals = run_epochs(
            self._ids,
            self.device,
            plans[0].epochs if plans else 0,
            run_epoch,
            until=until,
            max_epochs=max_epochs,
            active=active,
            where=lambda k: self.where(stage, k),
        )
        out = {**frozen, **carried, **train}
        return totals.fit({k: out[k] for k in params}, self.client_shape, until is not None)


def check_full_batches(table: EpochTable, model: UnitModel) -> None:
    """Refuse an epoch in which a client's batch is padded: batch norm would count the padding rows
    in its statistics (the engines run such clients one at a time, ``batching_blocker``)."""
    for part in table.tables:
        S = part.mask.shape[1]
        taken = torch.arange(S, device=part.mask.device) < table.steps.to(part.mask.device)[:, None]
        if bool(((part.mask.sum(-1) < part.mask.shape[-1]) & taken).any()):
            raise NotImplementedError(
                f"{type(model).__name__} has batch norm and a client's batch here is smaller than the others' "
                "(padded): batched training would count the padding in the batch statistics"
            )


def _add_term_value(term: ClosedFormTerm, values: Tensor, train: Params, frozen: Params, aux: Any) -> Tensor:
    """Each running client's loss ``values`` with a closed-form term's value added."""
    dims = (0, 0, 0, None if aux is None else 0)
    add = vmap(lambda v, tp, fz, a: term.add_value_only(v, {**fz, **tp}, a), in_dims=dims)
    return add(values, train, frozen, aux)


def _vmapped(fn: Callable[..., Any], aux: Any) -> Callable[..., Any]:
    """``fn(trainable, frozen, batch, aux)`` vmapped over the clients (``aux`` None: not mapped;
    a batch's absent fields, e.g. no mixup, are not mapped either)."""

    def call(trainable: Params, frozen: Params, batch: Any, aux_values: Any) -> Any:
        dims = (0, 0, _batch_dims(batch), None if aux_values is None else 0)
        return vmap(fn, in_dims=dims)(trainable, frozen, batch, aux_values)

    return call


def _batch_dims(batch: Any) -> Any:
    if isinstance(batch, Batch):
        return Batch._make(None if field is None else 0 for field in batch)  # vmap's in_dims of each field
    return tuple(_batch_dims(b) for b in batch)


def item(value: Any, k: int) -> Any:
    """Client ``k``'s entry of a per-client metric."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.dim() == 0 else value[k].item()
    if isinstance(value, (list, tuple)):
        return value[k]
    return value

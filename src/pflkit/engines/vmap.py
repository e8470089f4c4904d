"""The vmap engine: many clients trained at once with ``torch.func.vmap`` (made for GPUs).

A round's clients are sorted by training-set size (largest first) and cut into chunks of
``chunk_size``. Within a chunk, client states are stacked to ``[K, ...]`` and the algorithm's own
``local_init`` / ``local_train`` run once on a ``BatchedContext`` whose ``sgd`` advances every
client one mini-batch per vmapped step. Because clients are sorted, the clients that still have
batches at step s are a prefix of the chunk: each step computes only that prefix (no padding
work for finished clients); the only padding is inside the batch of a client with fewer
samples than one batch. Every client draws the same (seed, round, client) streams as on the
other engines, so results agree up to floating-point reassociation in batched kernels.
Models with buffers (batch norm: running statistics updated in place by training-mode forwards,
which vmap does not support in general) run client by client instead.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

import torch
from torch.func import grad_and_value, vmap
from torch.nn import functional as F

from ..algorithms.base import TrainSettings, batch_order
from ..data.federated import ClientData, FederatedData
from ..functional import NonFiniteLossError, Params, forward, torch_generator
from ..models import buffer_names
from .base import ClientJob, ClientResult, RoundSetup, run_client
from .stacking import stack, unstack

log = logging.getLogger(__name__)


class BatchedData:
    """What ``ctx.data`` offers algorithms in a batched context."""

    def __init__(self, clients: list[ClientData], device: torch.device) -> None:
        self.clients = clients
        self.num_train = torch.tensor([c.num_train for c in clients], device=device)


class BatchedContext:
    """The ClientContext API for K clients at once (tensors carry a leading client dimension)."""

    batched = True

    def __init__(self, client_ids: list[int], round: int, seed: int, data: FederatedData, model: torch.nn.Module,
                 units: Any, train: TrainSettings, algorithm: str) -> None:
        if data.x is None:
            raise ValueError("the vmap engine needs FederatedData with the dataset tensors (x, y)")
        self.client_ids = client_ids
        self.round = round
        self.seed = seed
        self.fed = data
        self.model = model
        self.units = units
        self.train = train
        self.algorithm = algorithm
        self.info: dict[str, Any] = {}
        self.clients = [data.client(i) for i in client_ids]
        self.device = data.x.device
        self.data = BatchedData(self.clients, self.device)

    def generator(self, purpose: str, k: int) -> torch.Generator:
        return torch_generator(self.seed, "client", self.round, self.client_ids[k], purpose)

    def where(self, stage: str, k: int | None = None) -> str:
        who = f"client {self.client_ids[k]}" if k is not None else f"clients {self.client_ids}"
        return f"algorithm {self.algorithm}, {who}, round {self.round}, {stage}"

    # ---- training ------------------------------------------------------------------------
    def step_rows(self, purpose: str, epochs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dataset rows [K, S, b], sample mask [K, S, b] and step counts [K] of every client's batches."""
        b = self.train.batch_size
        orders = [batch_order(c.num_train, b, epochs, self.generator(purpose, k)) for k, c in enumerate(self.clients)]
        steps = torch.tensor([len(o) for o in orders])
        rows = torch.zeros(len(orders), int(steps.max()), b, dtype=torch.long)
        mask = torch.zeros(len(orders), int(steps.max()), b)
        for k, (order, client) in enumerate(zip(orders, self.clients)):
            if order:
                local = torch.stack(order)  # [steps, size]
                rows[k, :len(order), :local.shape[1]] = client.train_rows.cpu()[local]
                mask[k, :len(order), :local.shape[1]] = 1.0
        return rows.to(self.device), mask.to(self.device), steps

    def sgd(self, params: Params, *, purpose: str = "train", epochs: int = 1, trainable: Sequence[str] | None = None,
            prox_anchor: Mapping[str, torch.Tensor] | None = None, prox_mu: float = 0.0,
            stage: str = "local training") -> tuple[Params, torch.Tensor]:
        """Batched ``ClientContext.sgd``: returns stacked parameters and per-client mean losses."""
        if buffer_names(self.model):
            raise NotImplementedError(f"batched training does not support models with buffers (batch norm: "
                                      f"{type(self.model).__name__}); the vmap engine runs them client by client")
        names = list(params) if trainable is None else list(trainable)
        train = {k: params[k].detach().clone() for k in names}
        frozen = {k: v.detach() for k, v in params.items() if k not in train}
        anchors = {k: prox_anchor[k].detach() for k in names} if prox_anchor is not None and prox_mu else None
        rows, mask, steps = self.step_rows(purpose, epochs)
        K = len(self.clients)
        loss_sum = torch.zeros(K, device=self.device)
        model, lr = self.model, self.train.lr

        def loss_fn(tp: Params, fp: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            logits = forward(model, {**fp, **tp}, x, train=True)
            return (F.cross_entropy(logits, y, reduction="none") * m).sum() / m.sum()

        step = vmap(grad_and_value(loss_fn))
        for s in range(int(steps.max()) if K else 0):
            active = int((steps > s).sum())  # a prefix: clients are sorted by size
            r, m = rows[:active, s], mask[:active, s]
            grads, losses = step({k: v[:active] for k, v in train.items()},
                                 {k: v[:active] for k, v in frozen.items()}, self.fed.x[r], self.fed.y[r], m)
            with torch.no_grad():
                leaves = [train[k][:active] for k in names]
                updates = [grads[k] for k in names]
                if anchors is not None:
                    updates = [g.add(w - anchors[k][:active], alpha=prox_mu) for g, w, k in zip(updates, leaves, names)]
                torch._foreach_add_(leaves, updates, alpha=-lr)
                loss_sum[:active] += losses.detach()
        mean_loss = loss_sum / steps.clamp(min=1).to(self.device)
        bad = (~torch.isfinite(mean_loss)).nonzero()
        if len(bad):
            k = int(bad[0])
            raise NonFiniteLossError(f"training loss became {float(mean_loss[k])} ({self.where(stage, k)}); "
                                     "lower the learning rate or check the data for NaN/inf values")
        return {**frozen, **train}, mean_loss

    # ---- evaluation ----------------------------------------------------------------------
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
            logits = run(params, self.fed.x[r])
            y = self.fed.y[r]
            correct += ((logits.argmax(-1) == y) & m).sum(1)
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(m)
            loss += (ce * m).sum(1)
        return [{"correct": int(correct[k]), "loss_sum": float(loss[k]), "num_samples": sizes[k]} for k in range(K)]


class VmapEngine:
    name = "vmap"

    def __init__(self, chunk_size: int = 64) -> None:
        self.chunk_size = chunk_size
        self._warned_buffers = False
        self._logged: set[str] = set()  # algorithms whose one-by-one fallback was logged

    def run(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> list[ClientResult]:
        alg = setup.algorithm
        if not getattr(alg, "supports_batching", True):
            if alg.name not in self._logged:
                self._logged.add(alg.name)
                log.info("vmap engine: %s trains with more than plain SGD (a custom loop); running its clients "
                         "one by one", alg.name)
            return [run_client(setup, job, round) for job in jobs]
        if buffer_names(setup.model):
            if not self._warned_buffers:
                log.info("vmap engine: %s has buffers (batch-norm running statistics, updated in place by "
                         "training-mode forwards, which vmap does not support); running clients one by one",
                         type(setup.model).__name__)
                self._warned_buffers = True
            return [run_client(setup, job, round) for job in jobs]
        order = sorted(range(len(jobs)), key=lambda j: -setup.data.client(jobs[j].client_id).num_train)
        results: dict[int, ClientResult] = {}
        for start in range(0, len(order), self.chunk_size):
            chunk = order[start:start + self.chunk_size]
            for j, res in zip(chunk, self._run_chunk(setup, [jobs[j] for j in chunk], round)):
                results[j] = res
        return [results[j] for j in range(len(jobs))]

    def _run_chunk(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> list[ClientResult]:
        alg = setup.algorithm
        ctx, payload, state, init_seconds = init_chunk(setup, jobs, round)
        evaluations = ctx.evaluate(alg.eval_params(state)) if jobs[0].evaluate else None
        upload, metrics = None, {}
        t1 = time.perf_counter()
        if jobs[0].train:
            state, upload, metrics = alg.local_train(payload, state, ctx)
        train_seconds = time.perf_counter() - t1
        K = len(jobs)
        out = []
        for k, job in enumerate(jobs):
            client_metrics: dict[str, Any] = {key: _item(v, k) for key, v in {**ctx.info, **metrics}.items()}
            # per-client shares of the chunk's wall time keep the round's sums meaningful
            client_metrics["init_seconds"] = init_seconds / K
            if upload is not None:
                client_metrics["train_seconds"] = train_seconds / K
            client_upload = None
            if upload is not None:
                client_upload = {key: (int(v[k]) if key == "num_samples" else unstack(v, k))
                                 for key, v in upload.items()}
            out.append(ClientResult(job.client_id, unstack(state, k, job.state), client_upload,
                                    evaluations[k] if evaluations is not None else None, client_metrics))
        return out

    def close(self) -> None:
        pass


def init_chunk(setup: RoundSetup, jobs: list[ClientJob], round: int,
               receive_only: bool = False) -> tuple[BatchedContext, Any, Any, float]:
    """Stack the jobs' payloads and states and run ``local_init`` (or only its ``receive``
    step) once for all of them."""
    alg = setup.algorithm
    ids = [job.client_id for job in jobs]
    ctx = BatchedContext(ids, round, setup.seed, setup.data, setup.model, setup.units, setup.train, alg.name)
    payload = stack([job.payload for job in jobs])
    t0 = time.perf_counter()
    init = alg.receive if receive_only else alg.local_init
    state = init(payload, stack([job.state for job in jobs]), ctx)
    return ctx, payload, state, time.perf_counter() - t0


def batched_local_init(setup: RoundSetup, jobs: list[ClientJob], round: int,
                       chunk_size: int = 64) -> list[tuple[Any, dict[str, Any]]]:
    """Per job (in job order): its state after the batched ``receive`` step (ALA) and its
    metrics, computed chunk-wise; ``after_receive`` is left to the per-client workers."""
    order = sorted(range(len(jobs)), key=lambda j: -setup.data.client(jobs[j].client_id).num_train)
    out: dict[int, tuple[Any, dict[str, Any]]] = {}
    for start in range(0, len(order), chunk_size):
        chunk = order[start:start + chunk_size]
        ctx, _, state, seconds = init_chunk(setup, [jobs[j] for j in chunk], round, receive_only=True)
        for k, j in enumerate(chunk):
            info = {key: _item(v, k) for key, v in ctx.info.items()}
            out[j] = (unstack(state, k, jobs[j].state), {**info, "init_seconds": seconds / len(chunk)})
    return [out[j] for j in range(len(jobs))]


def _item(value: Any, k: int) -> Any:
    if isinstance(value, torch.Tensor):
        return float(value[k]) if value.dim() else float(value)
    if isinstance(value, (list, tuple)):
        return value[k]
    return value

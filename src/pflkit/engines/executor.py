"""The one client executor: a round's client jobs run in groups, each group on one context.

A group is one client on the reference ``SingleClientContext`` or K clients on a
``BatchedClientContext``; :func:`run_group` runs the client part of a round (local_init ->
evaluate -> local_train, steps 3-5 of "A round in ten steps" in docs/explanations/design.md) for a
group, whatever its size, and splits the results back per client. The engines are this executor
with other numbers:

* ``loop``: groups of one, one after another (the reference);
* ``parallel``: groups of one spread over worker threads (largest first, so the idle tail of a
  round is at most one client's work), and for algorithms whose ``receive`` trains
  (``Algorithm.trains_on_receive``) that step first on batched groups of ``receive_chunk``
  clients, since its many tiny steps would serialise on Python's GIL (a wave of clients at a
  time, received then trained);
* ``vmap``: batched groups of ``chunk_size`` clients (made for GPUs);
* ``vmap-graphs``: ``vmap`` with each epoch's steps recorded once as CUDA graphs and replayed.

Groups are cut from the clients sorted by training-set size (largest first): within a batched
group the clients that still have batches at a step are then a prefix (no padding work), and the
groups do not depend on the number of workers, so neither do the numbers. Algorithms or models
that cannot share a batched context (``batching_blocker``) run in groups of one, logged once.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import torch

from ..algorithms.base import Algorithm, Upload
from ..algorithms.context import Metrics, TrainBatches
from ..data.federated import FederatedData
from ..functional import Ensemble, Params
from ..functional.training import classification_loss
from ..models import UnitModel, buffer_names
from .base import ClientJob, ClientResult, RoundSetup
from .batched import BatchedClientContext
from .client import SingleClientContext
from .graphs import CudaGraphRecorder, Recorder

log = logging.getLogger(__name__)
T = TypeVar("T")
Context = SingleClientContext | BatchedClientContext


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def batching_blocker(algorithm: Any, model: UnitModel, data: FederatedData) -> str | None:
    """Why ``algorithm``'s clients cannot share a batched context here, or None if they can."""
    missing = set(algorithm.needs) - BatchedClientContext.provides
    if missing:
        return f"{algorithm.name} needs {', '.join(sorted(missing))} client code"
    if buffer_names(model):
        batch = algorithm.smallest_full_client()
        small = [i for i in range(data.num_clients) if data.client(i).num_train < batch]
        if getattr(algorithm, "trains_on_receive", False):
            return (
                f"{type(model).__name__} has batch norm and {algorithm.name} trains on samples whose last "
                "batches differ in size across clients: batched, their padding would enter the batch statistics"
            )
        if small:
            return (
                f"{type(model).__name__} has batch norm and client {small[0]} holds fewer training samples "
                f"({data.client(small[0]).num_train}) than one batch ({batch}): batched, its padded batch "
                "would enter the batch statistics"
            )
    if data.x is None:
        return "the data holds no dataset tensors to gather batches from"
    return None


def size_order(data: FederatedData, client_ids: Sequence[int]) -> list[int]:
    """Positions of ``client_ids`` by training-set size, largest first (step counts decrease)."""
    return sorted(range(len(client_ids)), key=lambda j: -data.client(client_ids[j]).num_train)


def group_context(
    setup: RoundSetup,
    client_ids: Sequence[int],
    round: int,
    batched: bool,
    graphs: Callable[[Any], Recorder] | None = None,
) -> Context:
    """The context of a group: the reference per-client context, or a batched one (``graphs``: the
    recorder that replays its steps as CUDA graphs, module ``graphs``)."""
    if batched:
        return BatchedClientContext(
            list(client_ids),
            round,
            setup.seed,
            setup.data,
            setup.model,
            setup.units,
            setup.train,
            setup.algorithm.name,
            cancel=setup.cancel,
            graphs=graphs,
        )
    (client_id,) = client_ids
    return setup.context(client_id, round)


def run_group(
    setup: RoundSetup,
    jobs: Sequence[ClientJob],
    round: int,
    ctx: Context,
    received: Sequence[Metrics | None] | None = None,
) -> list[ClientResult]:
    """local_init -> (evaluate) -> (local_train) for the group's clients on ``ctx``.

    ``received`` holds the metrics of a ``receive`` step that already ran (:func:`receive_group`);
    the jobs' states are then the received ones and only ``after_receive`` runs here. A group's
    wall times are shared equally among its clients, so that a round's sums stay meaningful."""
    alg, K = setup.algorithm, len(jobs)
    payload = ctx.gather([job.payload for job in jobs])
    state = ctx.gather([job.state for job in jobs])
    t0 = time.perf_counter()
    if received is None:
        state, metrics = alg.local_init(payload, state, ctx)
    else:
        state, metrics = alg.after_receive(payload, state, ctx)
    seconds = {"init_seconds": time.perf_counter() - t0}
    evaluations = None
    if jobs[0].evaluate:
        t1 = time.perf_counter()
        scored = alg.eval_params(state)
        if jobs[0].finetune or jobs[0].finetune_steps:
            scored, tuned = finetuned(
                alg, scored, ctx, jobs[0].finetune or 0, jobs[0].finetune_steps, jobs[0].finetune_lr
            )
            metrics = {**metrics, **tuned}
        evaluations = ctx.evaluate(scored)
        seconds["eval_seconds"] = time.perf_counter() - t1
    upload: Upload | None = None
    train_metrics: Metrics = {}
    if jobs[0].train:
        ctx.work = {job.client_id: job.work for job in jobs if job.work < 1}  # stragglers take fewer steps
        t2 = time.perf_counter()
        state, upload, train_metrics = alg.local_train(payload, state, ctx)
        seconds["train_seconds"] = time.perf_counter() - t2
    out = []
    for k, job in enumerate(jobs):
        before = dict(received[k] or {}) if received is not None else {}
        client_metrics = {**before, **ctx.split_metrics({**metrics, **train_metrics}, k)}
        for key, value in seconds.items():
            client_metrics[key] = before.get(key, 0.0) + value / K
        client_state = ctx.split(state, k, job.state)
        client_upload = None
        if upload is not None:
            client_upload = ctx.split(upload, k, {"num_samples": 0})
            for metric in setup.local_model_metrics:
                client_metrics.update(metric(setup, job.client_id, alg.local_model(client_state)))
        evaluation = evaluations[k] if evaluations is not None else None
        out.append(ClientResult(job.client_id, client_state, client_upload, evaluation, client_metrics))
    return out


def finetuned(
    alg: Algorithm,
    params: Params | Ensemble,
    ctx: Context,
    epochs: int,
    steps: int | None = None,
    lr: float | None = None,
) -> tuple[Params, Metrics]:
    """A newcomer's scored model after ``epochs`` epochs (or, with ``steps``, that many batches,
    reshuffled each epoch) of cross-entropy SGD on its training split (the run's train settings,
    its own batch stream; ``lr`` in place of the run's), and the fine-tuning's mean loss. The
    model's parameters train; a method's other entries (modules between body and head, their
    inputs) stay as the newcomer received them."""
    if isinstance(params, Ensemble):
        raise ValueError(f"{alg.name} scores an ensemble of models: unseen fine-tuning needs a single model")
    # every epoch has at least one batch, so ``steps`` epochs hold the ``steps`` batches
    batches = (
        TrainBatches("unseen-finetune", epochs)
        if steps is None
        else TrainBatches("unseen-finetune", steps, max_steps=steps)
    )
    fit = ctx.fit(
        dict(params),
        classification_loss,
        trainable=[k for k in alg.parameter_names if k in params],
        data=batches,
        optimizer=None if lr is None else ctx.train.optimizer(lr),
        stage="fine-tuning of an unseen client",
    )
    return fit.params, {"finetune_loss": fit.loss}


def receive_group(
    setup: RoundSetup, jobs: Sequence[ClientJob], round: int, ctx: Context
) -> tuple[list[ClientJob], list[Metrics]]:
    """Only ``receive`` for the group's clients: their jobs with the received states, and its metrics."""
    t0 = time.perf_counter()
    state, info = setup.algorithm.receive(
        ctx.gather([job.payload for job in jobs]), ctx.gather([job.state for job in jobs]), ctx
    )
    seconds = (time.perf_counter() - t0) / len(jobs)
    return (
        [replace(job, state=ctx.split(state, k, job.state)) for k, job in enumerate(jobs)],
        [{**ctx.split_metrics(info, k), "init_seconds": seconds} for k in range(len(jobs))],
    )


def run_client(setup: RoundSetup, job: ClientJob, round: int) -> ClientResult:
    """One client's part of a round on its own context (Flower's ClientApp, tests)."""
    return run_group(setup, [job], round, group_context(setup, [job.client_id], round, False))[0]


class ClientExecutor:
    """Runs the client jobs of a round in groups (see the module docstring); results in job order.

    ``chunk_size``: clients per group (1: per-client contexts; more: batched contexts);
    ``workers``: threads the groups are spread over (each with its own model skeleton and the
    intra-op thread count the executor was built under);
    ``receive_chunk``: batch the ``receive`` step of algorithms that train in it in groups of
    this size first (None: no separate receive step); ``graphs``: the recorder of batched groups'
    steps (CUDA graphs), None: eager steps."""

    def __init__(
        self,
        name: str,
        *,
        chunk_size: int = 1,
        workers: int = 1,
        receive_chunk: int | None = None,
        graphs: Callable[[Any], Recorder] | None = None,
    ) -> None:
        self.name = name
        self.graphs = graphs
        self.chunk_size = chunk_size
        self.workers = workers
        self.receive_chunk = receive_chunk
        # A new thread's OpenMP team has OMP_NUM_THREADS (or all cores) until torch sets it, and
        # oneDNN's convolutions read it first: their sums would then depend on which thread ran them.
        self._pool = (
            ThreadPoolExecutor(
                workers,
                thread_name_prefix="pflkit-client",
                initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),),
            )
            if workers > 1
            else None
        )
        self._local = threading.local()
        self._logged: set[str] = set()
        self._abandon = threading.Event()  # set when the caller stops taking results: jobs in flight stop

    def run(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> list[ClientResult]:
        results: dict[int, ClientResult] = {}
        for group, out in self._group_results(setup, jobs, round):
            results.update(zip(group, out))
        return [results[j] for j in range(len(jobs))]

    def stream(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> Iterator[ClientResult]:
        """The results group by group, in the groups' order (training-set size, largest first, then
        job order): a client's state is read when its group is submitted and let go once its result
        is taken, so a round holds only the clients in flight (see ``window``)."""
        for _group, out in self._group_results(setup, jobs, round):
            yield from out

    def _group_results(
        self, setup: RoundSetup, jobs: list[ClientJob], round: int
    ) -> Iterator[tuple[list[int], list[ClientResult]]]:
        """(job positions, results) group by group. Where the ``receive`` step runs batched first
        (``trains_on_receive`` on the parallel engine), the round goes in waves of ``wave`` clients (whole receive
        chunks, in size order): each wave is received, then trained, so only a wave's received
        states are held; the chunks and groups are those of one wave over the whole round."""
        self._abandon.clear()
        setup = replace(setup, cancel=self._abandon)
        receives = self._receives_first(setup)
        order = size_order(setup.data, [job.client_id for job in jobs])
        step = self.wave if receives else max(1, len(order))
        for begin in range(0, len(order), step):
            wave = order[begin : begin + step]
            wave_jobs, received = self.receive(setup, [jobs[j] for j in wave], round)
            for group, out in self._run_groups(setup, wave_jobs, received, round):
                yield [wave[k] for k in group], out

    def _run_groups(
        self, setup: RoundSetup, jobs: list[ClientJob], received: list[Metrics | None], round: int
    ) -> Iterator[tuple[list[int], list[ClientResult]]]:
        batched = self.chunk_size > 1 and self._batchable(setup, "clients")
        groups = self._groups(setup, jobs, self.chunk_size if batched else 1)
        pending: list[ClientJob | None] = list(jobs)

        def start(group: list[int]) -> list[ClientJob]:  # on the calling thread: the store is not shared
            group_jobs = []
            for j in group:
                job = pending[j]
                assert job is not None  # a job is released only after its group ran
                group_jobs.append(job.loaded())
            return group_jobs

        def run(group: list[int], group_jobs: list[ClientJob]) -> list[ClientResult]:
            ctx_setup, _, _, ctx = self._on_worker(setup, group_jobs, round, batched)
            before = [received[j] for j in group]
            return self._run_group(ctx_setup, group_jobs, round, ctx, None if before[0] is None else before)

        for group, out in zip(groups, self._map(run, groups, start)):
            for j in group:
                pending[j] = None  # the job's state is the result's now
            yield group, out

    def _receives_first(self, setup: RoundSetup) -> bool:
        return bool(
            self.receive_chunk and setup.algorithm.trains_on_receive and self._batchable(setup, "local initialisation")
        )

    @property
    def wave(self) -> int:
        """Clients received together before they train (a multiple of ``receive_chunk``)."""
        return (self.receive_chunk or 1) * 4 * self.workers

    def receive(
        self, setup: RoundSetup, jobs: list[ClientJob], round: int
    ) -> tuple[list[ClientJob], list[Metrics | None]]:
        """With ``receive_chunk``, the ``receive`` step of an algorithm that trains in it, on batched
        groups: the jobs with their received states and the step's metrics (else the jobs as they are)."""
        received: list[Metrics | None] = [None] * len(jobs)
        if not self._receives_first(setup):
            return jobs, received
        assert self.receive_chunk  # (_receives_first)
        groups = self._groups(setup, jobs, self.receive_chunk)

        def run(group: list[int], group_jobs: list[ClientJob]) -> tuple[list[ClientJob], list[Metrics]]:
            return receive_group(*self._on_worker(setup, group_jobs, round, True))

        out = list(jobs)
        for group, (new_jobs, metrics) in zip(groups, self._map(run, groups, lambda g: [jobs[j].loaded() for j in g])):
            for j, job, info in zip(group, new_jobs, metrics):
                out[j], received[j] = job, info
        return out, received

    def _run_group(
        self, setup: RoundSetup, jobs: list[ClientJob], round: int, ctx: Context, received: list[Metrics | None] | None
    ) -> list[ClientResult]:
        return run_group(setup, jobs, round, ctx, received)

    def _batchable(self, setup: RoundSetup, what: str) -> bool:
        blocker = batching_blocker(setup.algorithm, setup.model, setup.data)
        if blocker is not None and blocker not in self._logged:
            self._logged.add(blocker)
            log.info("%s engine: %s; running %s's %s one by one", self.name, blocker, setup.algorithm.name, what)
        return blocker is None

    @staticmethod
    def _groups(setup: RoundSetup, jobs: Sequence[ClientJob], size: int) -> list[list[int]]:
        order = size_order(setup.data, [job.client_id for job in jobs])
        return [order[start : start + size] for start in range(0, len(order), size)]

    def _on_worker(
        self, setup: RoundSetup, group_jobs: list[ClientJob], round: int, batched: bool
    ) -> tuple[RoundSetup, list[ClientJob], int, Context]:
        """The setup (this thread's model skeleton), jobs, round and context of a group."""
        if self._pool is not None:
            setup = replace(setup, model=self._model(setup.model))
        return (
            setup,
            group_jobs,
            round,
            group_context(
                setup, [job.client_id for job in group_jobs], round, batched, self.graphs if batched else None
            ),
        )

    def _model(self, model: UnitModel) -> UnitModel:
        """This worker thread's copy of the model skeleton (module calls swap its parameters)."""
        cache = getattr(self._local, "models", None)
        if cache is None or cache[0] is not model:
            cache = self._local.models = (model, copy.deepcopy(model))
        return cache[1]

    @property
    def window(self) -> int:
        """Groups submitted to the workers ahead of the one whose result is awaited: enough that a
        large client at the head keeps no worker idle, few enough that memory stays flat."""
        return 16 * self.workers

    def _map(
        self,
        fn: Callable[[list[int], list[ClientJob]], T],
        groups: list[list[int]],
        start: Callable[[list[int]], list[ClientJob]],
    ) -> Iterator[T]:
        """``fn(group, start(group))`` for every group, yielded in the groups' order; ``start`` runs
        on the calling thread as a group is submitted, at most ``window`` groups ahead."""
        pool = self._pool
        if pool is None or len(groups) <= 1:
            for group in groups:
                yield fn(group, start(group))
            return
        queue, pending = iter(groups), deque[Future[T]]()

        def submit() -> None:
            group = next(queue, None)
            if group is not None:
                pending.append(pool.submit(fn, group, start(group)))

        try:
            for _ in range(self.window):
                submit()
            while pending:
                out = pending[0].result()
                pending.popleft()
                submit()
                yield out
        except BaseException:
            if pending:  # a failed client or a stopped run: queued clients do not start, running ones stop
                self._abandon.set()
            raise
        finally:
            for future in pending:
                future.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # a stopped run does not train the queued clients


class LoopEngine(ClientExecutor):
    """The reference: one client after another."""

    def __init__(self) -> None:
        super().__init__("loop")


class ParallelEngine(ClientExecutor):
    """Clients over worker threads (PyTorch kernels release the GIL; the dataset stays shared)."""

    def __init__(self, workers: int | None = None, receive_chunk: int = 8) -> None:
        """``receive_chunk``: clients batched together in the ``receive`` step of algorithms that
        train in it (``Algorithm.trains_on_receive``)."""
        super().__init__("parallel", workers=workers or default_workers(), receive_chunk=receive_chunk)


class VmapEngine(ClientExecutor):
    """Chunks of clients batched with ``torch.func.vmap`` (default 64 per chunk, which bounds
    memory); ``graphs``: on CUDA, each epoch's steps replayed as CUDA graphs (``vmap-graphs``)."""

    def __init__(self, chunk_size: int = 64, graphs: bool = False) -> None:
        name = "vmap-graphs" if graphs else "vmap"
        super().__init__(name, chunk_size=chunk_size, graphs=CudaGraphRecorder if graphs else None)

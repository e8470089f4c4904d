"""Parallel CPU engine: the clients of a round spread over worker threads.

PyTorch kernels release the GIL, so worker threads run client training truly in parallel; the
dataset stays shared in memory (no copies, no pickling) and each worker owns a model skeleton.
Jobs are submitted longest first (by training samples), which bounds the idle tail of a round
by one client's work. Algorithms whose ``receive`` trains (``Algorithm.trains_on_receive``: ALA)
run that step first on batched contexts, in fixed chunks of ``ala_chunk_size`` clients (by size)
spread over the workers: ALA's thousands of tiny steps would otherwise serialise on Python's
GIL. Every client draws from its own (seed, round, client) streams, each worker keeps the
configured intra-op thread count and the chunks do not depend on the worker count, so the
numbers do not depend on the number of workers or on scheduling.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from torch import nn

from ..algorithms.context import Metrics
from .base import ClientJob, ClientResult, RoundSetup, run_client
from .batched import BatchedClientContext, batching_blocker, item, size_order
from .stacking import stack, unstack

log = logging.getLogger(__name__)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class ParallelEngine:
    name = "parallel"

    def __init__(self, workers: int | None = None, ala_chunk_size: int = 8) -> None:
        self.workers = workers or default_workers()
        self.ala_chunk_size = ala_chunk_size
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="pflkit-client")
        self._local = threading.local()
        self._logged: set[str] = set()

    def _model(self, model: nn.Module) -> nn.Module:
        cache = getattr(self._local, "models", None)
        if cache is None or cache[0] is not model:
            cache = self._local.models = (model, copy.deepcopy(model))
        return cache[1]

    def _run_one(self, setup: RoundSetup, job: ClientJob, round: int, received: Metrics | None) -> ClientResult:
        return run_client(replace(setup, model=self._model(setup.model)), job, round, received)

    def run(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> list[ClientResult]:
        received: list[Metrics | None] = [None] * len(jobs)
        if setup.algorithm.trains_on_receive:
            blocker = batching_blocker(setup.algorithm, setup.model, setup.data)
            if blocker is None:
                jobs, received = self._receive_batched(setup, jobs, round)  # type: ignore[assignment]
            elif blocker not in self._logged:
                self._logged.add(blocker)
                log.info("parallel engine: %s; running %s's local initialisation per client", blocker,
                         setup.algorithm.name)
        if self.workers == 1 or len(jobs) <= 1:
            return [run_client(setup, job, round, r) for job, r in zip(jobs, received)]
        order = size_order(setup.data, [job.client_id for job in jobs])
        futures = {j: self._pool.submit(self._run_one, setup, jobs[j], round, received[j]) for j in order}
        return [futures[j].result() for j in range(len(jobs))]

    def _receive_batched(self, setup: RoundSetup, jobs: list[ClientJob],
                         round: int) -> tuple[list[ClientJob], list[Metrics]]:
        """Every job's ``receive`` on batched contexts, the chunks spread over the worker threads.

        The chunks (``ala_chunk_size`` clients, by size) and the intra-op thread count are the same
        for any number of workers, so each client's numbers are too: a batched kernel's reduction
        order may depend on its thread count and on what it is batched with, never on scheduling."""
        alg = setup.algorithm
        order = size_order(setup.data, [job.client_id for job in jobs])
        chunks = [order[start:start + self.ala_chunk_size] for start in range(0, len(order), self.ala_chunk_size)]

        def receive(chunk: list[int]) -> tuple[Any, Metrics, float]:
            ctx = BatchedClientContext([jobs[j].client_id for j in chunk], round, setup.seed, setup.data,
                                       setup.model, setup.units, setup.train, alg.name)
            t0 = time.perf_counter()
            state, info = alg.receive(stack([jobs[j].payload for j in chunk]), stack([jobs[j].state for j in chunk]),
                                      ctx)
            return state, info, (time.perf_counter() - t0) / len(chunk)

        if self.workers == 1 or len(chunks) == 1:
            outputs = [receive(chunk) for chunk in chunks]
        else:
            outputs = list(self._pool.map(receive, chunks))
        new_jobs, metrics = list(jobs), [{} for _ in jobs]
        for chunk, (state, info, seconds) in zip(chunks, outputs):
            for k, j in enumerate(chunk):
                new_jobs[j] = replace(jobs[j], state=unstack(state, k, jobs[j].state))
                metrics[j] = {**{key: item(v, k) for key, v in info.items()}, "init_seconds": seconds}
        return new_jobs, metrics

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # a stopped run does not train the queued clients

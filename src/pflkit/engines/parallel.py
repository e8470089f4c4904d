"""Parallel CPU engine: the clients of a round spread over worker threads.

PyTorch kernels release the GIL, so worker threads run client training truly in parallel; the
dataset stays shared in memory (no copies, no pickling) and each worker owns a model skeleton
(``functional_call`` temporarily swaps a module's parameters, so a skeleton cannot be shared).
Jobs are submitted longest first (by training samples), which bounds the idle tail of a round
by one client's work. Algorithms with ALA run their local initialisation for all clients of the
round at once first (``batched_init``): ALA's thousands of tiny steps would otherwise serialise
on Python's GIL (not for models with buffers, batch norm: their ALA runs per client). Every
client draws from its own (seed, round, client) streams, so the numbers do not depend on the
number of workers or on scheduling.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..models import buffer_names
from .base import ClientJob, ClientResult, RoundSetup, run_client
from .vmap import batched_local_init

log = logging.getLogger(__name__)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class ParallelEngine:
    name = "parallel"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="pflkit-client")
        self._local = threading.local()
        self._warned_buffers = False

    def _model(self, model: nn.Module) -> nn.Module:
        cache = getattr(self._local, "models", None)
        if cache is None or cache[0] is not model:
            cache = self._local.models = (model, copy.deepcopy(model))
        return cache[1]

    def _run_one(self, setup: RoundSetup, job: ClientJob, round: int,
                 initialized: dict[str, Any] | None) -> ClientResult:
        return run_client(replace(setup, model=self._model(setup.model)), job, round, initialized)

    def run(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> list[ClientResult]:
        inits: list[dict[str, Any] | None] = [None] * len(jobs)
        batched_init = getattr(setup.algorithm, "batched_init", False) and setup.data.x is not None
        if batched_init and buffer_names(setup.model):
            if not self._warned_buffers:
                log.info("parallel engine: %s has buffers (batch-norm running statistics); running %s's "
                         "local initialisation per client instead of batched", type(setup.model).__name__,
                         setup.algorithm.name)
                self._warned_buffers = True
            batched_init = False
        if batched_init:
            # ALA's many tiny steps are bound by Python's GIL in threads: run them for all
            # clients at once (batched, with an active set), then evaluate/train in threads.
            previous = torch.get_num_threads()
            torch.set_num_threads(previous * self.workers)
            try:
                initialised = batched_local_init(setup, jobs, round)
            finally:
                torch.set_num_threads(previous)
            jobs = [replace(job, state=state) for job, (state, _) in zip(jobs, initialised)]
            inits = [info for _, info in initialised]
        if self.workers == 1 or len(jobs) <= 1:
            return [run_client(setup, job, round, init) for job, init in zip(jobs, inits)]
        order = sorted(range(len(jobs)), key=lambda j: -setup.data.client(jobs[j].client_id).num_train)
        futures = {j: self._pool.submit(self._run_one, setup, jobs[j], round, inits[j]) for j in order}
        return [futures[j].result() for j in range(len(jobs))]

    def close(self) -> None:
        self._pool.shutdown(wait=True)

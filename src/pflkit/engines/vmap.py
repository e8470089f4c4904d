"""The vmap engine: many clients trained at once with ``torch.func.vmap`` (made for GPUs).

A round's clients are sorted by training-set size (largest first) and cut into chunks of
``chunk_size``. Within a chunk, payloads and states are stacked to ``[K, ...]`` and the
algorithm's own ``local_init`` / ``local_train`` run once on a ``BatchedClientContext``.
Algorithms that need per-client contexts, and models with buffers (batch norm), run client by
client instead (logged once per reason).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .base import ClientJob, ClientResult, RoundSetup, adaptability_metrics, run_client
from .batched import BatchedClientContext, batching_blocker, item, size_order
from .stacking import stack, unstack

log = logging.getLogger(__name__)


class VmapEngine:
    name = "vmap"

    def __init__(self, chunk_size: int = 64) -> None:
        self.chunk_size = chunk_size
        self._logged: set[str] = set()  # fallback reasons already logged

    def run(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> list[ClientResult]:
        blocker = batching_blocker(setup.algorithm, setup.model, setup.data)
        if blocker is not None:
            if blocker not in self._logged:
                self._logged.add(blocker)
                log.info("vmap engine: %s; running %s's clients one by one", blocker, setup.algorithm.name)
            return [run_client(setup, job, round) for job in jobs]
        order = size_order(setup.data, [job.client_id for job in jobs])
        results: dict[int, ClientResult] = {}
        for start in range(0, len(order), self.chunk_size):
            chunk = order[start:start + self.chunk_size]
            for j, res in zip(chunk, self._run_chunk(setup, [jobs[j] for j in chunk], round)):
                results[j] = res
        return [results[j] for j in range(len(jobs))]

    def _run_chunk(self, setup: RoundSetup, jobs: list[ClientJob], round: int) -> list[ClientResult]:
        alg = setup.algorithm
        ctx = BatchedClientContext([job.client_id for job in jobs], round, setup.seed, setup.data, setup.model,
                                   setup.units, setup.train, alg.name)
        payload = stack([job.payload for job in jobs])
        t0 = time.perf_counter()
        state, metrics = alg.local_init(payload, stack([job.state for job in jobs]), ctx)
        init_seconds = time.perf_counter() - t0
        evaluations = ctx.evaluate(alg.eval_params(state)) if jobs[0].evaluate else None
        upload, train_metrics = None, {}
        t1 = time.perf_counter()
        if jobs[0].train:
            state, upload, train_metrics = alg.local_train(payload, state, ctx)
        train_seconds = time.perf_counter() - t1
        K = len(jobs)
        out = []
        for k, job in enumerate(jobs):
            client_metrics: dict[str, Any] = {key: item(v, k) for key, v in {**metrics, **train_metrics}.items()}
            # per-client shares of the chunk's wall time keep the round's sums meaningful
            client_metrics["init_seconds"] = init_seconds / K
            client_upload = None
            if upload is not None:
                client_metrics["train_seconds"] = train_seconds / K
                client_upload = {key: (int(v[k]) if key == "num_samples" else unstack(v, k))
                                 for key, v in upload.items()}
            client_state = unstack(state, k, job.state)
            if upload is not None and setup.adaptability is not None:
                client_metrics.update(adaptability_metrics(setup, job.client_id, alg.local_model(client_state)))
            out.append(ClientResult(job.client_id, client_state, client_upload,  # type: ignore
                                    evaluations[k] if evaluations is not None else None, client_metrics))
        return out

    def close(self) -> None:
        pass

"""A batched training step replayed as a CUDA graph (the ``vmap-graphs`` engine).

A vmapped step of a small model on a GPU is bound by launching its few hundred kernels from
Python, not by their arithmetic. A CUDA graph records the kernels of one step once and launches
them all with one call. The step's shapes depend only on how many clients still run (``n``: a
prefix of the running clients, see ``batched``), so one graph per ``n`` serves every step of an
epoch that runs ``n`` clients.

A step function that a graph may record reads every input from tensors that outlive the epoch
(parameters, optimiser state, the epoch's batch table, the totals) and the step number from
:attr:`StepGraphs.step_index`, a device tensor set before each step, and writes its results in
place. For each ``n`` the first step runs eagerly (the warm-up CUDA asks for before a capture),
the second is captured and replayed, the rest are replayed. ``n`` values that last fewer than
``min_run`` steps run eagerly: a capture costs about one eager step. A step that cannot be
captured (it reads a value back to the host, say) is logged once and the fit goes on eagerly.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(__name__)

Step = Callable[[], None]
_warned: set[str] = set()


class Replay(Protocol):
    def replay(self) -> None: ...


class Recorder(Protocol):
    """How steps are warmed up and recorded: CUDA graphs, or a stand-in in tests."""

    def warm(self, step: Step) -> None: ...

    def capture(self, step: Step) -> Replay: ...


class CudaGraphRecorder:
    """Warm-up on a side stream, then ``torch.cuda.graph`` capture (PyTorch's recipe)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs replay steps on a CUDA device, not on {device.type}: use engine vmap")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool for an epoch's graphs
        self.syncs: list[str] = []  # where the last warm-up synchronised with the host

    def warm(self, step: Step) -> None:
        """Take the step on a side stream; note where it synchronises with the host (a read that
        a capture cannot record) in :attr:`syncs`, for the warning if the capture then fails."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.cuda.stream(side):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        current.wait_stream(side)
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        self.syncs = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
        for w in caught:  # the step's other warnings, as they would have been shown
            if w not in syncs:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def capture(self, step: Step) -> Replay:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        return graph


class StepGraphs:
    """The graphs of one epoch's steps, one per number of running clients."""

    def __init__(self, recorder: Recorder, device: torch.device, where: str, min_run: int = 4) -> None:
        self.recorder = recorder
        self.where = where
        self.min_run = min_run
        #: the step the recorded step functions gather their batch for
        self.step_index = torch.zeros((), dtype=torch.long, device=device)
        self.graphs: dict[int, Replay] = {}
        self.warmed: set[int] = set()
        self.failed = False
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}

    def run(self, n: int, s: int, left: int, step: Step) -> None:
        """Take step ``s`` with ``n`` clients running, ``left`` steps (this one included) before
        ``n`` changes; ``step`` reads the step number from :attr:`step_index`."""
        self.step_index.fill_(s)
        graph = self.graphs.get(n)
        if graph is None and not self.failed and n in self.warmed:
            graph = self._capture(n, step)
        if graph is not None:
            graph.replay()
            self.counts["replayed"] += 1
            return
        if not self.failed and left >= self.min_run and n not in self.warmed:
            self.recorder.warm(step)
            self.warmed.add(n)
        else:
            step()
        self.counts["eager"] += 1

    def _capture(self, n: int, step: Step) -> Replay | None:
        try:
            graph = self.recorder.capture(step)
        except RuntimeError as exc:  # e.g. "operation not permitted when stream is capturing"
            self.failed = True
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            syncs = getattr(self.recorder, "syncs", [])
            if syncs:
                reason += f"; it synchronises with the host at {', '.join(syncs)}"
            if reason not in _warned:  # once per reason, not once per epoch
                _warned.add(reason)
                log.warning("CUDA graphs: a step of %s could not be recorded (%s); it runs eagerly", self.where, reason)
            return None
        self.graphs[n] = graph
        self.counts["captured"] += 1
        return graph

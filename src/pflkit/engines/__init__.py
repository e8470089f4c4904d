"""Engines: how the client jobs of a round are executed (the same algorithm code on each)."""

from __future__ import annotations

from .base import ClientJob, ClientResult, Engine, RoundSetup
from .batched import BatchedClientContext
from .client import SingleClientContext
from .executor import ClientExecutor, LoopEngine, ParallelEngine, VmapEngine, default_workers, run_client

ENGINES = ("loop", "parallel", "vmap", "vmap-graphs")


def build_engine(name: str, *, workers: int | None = None, device: str = "cpu") -> Engine:
    """``auto``: vmap on CUDA, the parallel CPU engine on CPU."""
    if name == "auto":
        name = "vmap" if device == "cuda" else "parallel"
    if name == "loop":
        return LoopEngine()
    if name == "parallel":
        return ParallelEngine(workers)
    if name == "vmap":
        return VmapEngine()
    if name == "vmap-graphs":
        if not str(device).startswith("cuda"):
            raise ValueError(f"engine vmap-graphs replays CUDA graphs: it needs device cuda, not {device!r}")
        return VmapEngine(graphs=True)
    raise ValueError(f"unknown engine {name!r}; available: auto, {', '.join(ENGINES)}")


__all__ = [
    "ClientJob",
    "ClientResult",
    "Engine",
    "RoundSetup",
    "run_client",
    "BatchedClientContext",
    "SingleClientContext",
    "ClientExecutor",
    "LoopEngine",
    "ParallelEngine",
    "VmapEngine",
    "build_engine",
    "default_workers",
]

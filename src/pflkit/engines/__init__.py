"""Engines: how the client jobs of a round are executed (same algorithm code on each)."""

from __future__ import annotations

from .base import ClientJob, ClientResult, Engine, RoundSetup, run_client
from .loop import LoopEngine

ENGINES = {"loop": LoopEngine}


def build_engine(name: str) -> Engine:
    """``auto`` picks the fastest engine available for the device (only ``loop`` exists so far)."""
    if name == "auto":
        name = "loop"
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; available: auto, {', '.join(ENGINES)}")
    return ENGINES[name]()


__all__ = ["ClientJob", "ClientResult", "Engine", "RoundSetup", "run_client", "LoopEngine", "build_engine"]

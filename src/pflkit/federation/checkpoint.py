"""Atomic checkpoints of a RunState (safe against kill -9 at any moment)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ..algorithms import Algorithm
from ..functional import to_device
from .driver import RunState
from .state_store import ClientStore, DiskStateStore, MemoryStateStore
from .stopping import signals_deferred


def save_checkpoint(path: Path, state: RunState) -> None:
    """Write ``state`` atomically. With the disk store the clients stay in their files: they are
    fsync'ed first, the checkpoint names their versions, and versions it no longer needs go.
    Ctrl-C and SIGTERM wait until it is written."""
    with signals_deferred():
        _save_checkpoint(path, state)


def _save_checkpoint(path: Path, state: RunState) -> None:
    raw = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    clients, record = state.clients.checkpoint_record()
    raw["clients"] = dict(clients)
    if record is not None:
        # the folder relative to the checkpoint, so that a moved results folder still finds its clients
        raw["client_store"] = {**record, "folder": os.path.relpath(record["folder"], path.parent)}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(raw, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    state.clients.prune()


def load_checkpoint(path: Path, device: torch.device | str = "cpu", store: ClientStore | None = None) -> RunState:
    """The run state saved at ``path``. Clients kept in files (the disk store) continue in
    ``store`` (restored to the checkpoint's versions); without one they are a read-only view."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
        raw["server"] = to_device(raw["server"], device)
        raw["clients"] = MemoryStateStore(to_device(raw["clients"], device))
        state = RunState(**raw)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise RuntimeError(
            f"checkpoint {path} is unreadable (corrupt or truncated: {type(exc).__name__}); delete "
            "it to restart that run from round 0"
        ) from exc
    record = state.client_store
    if record is None:
        if store is not None and not isinstance(store, MemoryStateStore):
            raise RuntimeError(
                f"checkpoint {path} holds its clients' states but this run keeps them on disk (state_store changed)"
            )
        return state
    if store is None:
        state.clients = DiskStateStore.view(path.parent / record["folder"], record, device)
    elif not isinstance(store, DiskStateStore):
        raise RuntimeError(f"checkpoint {path} keeps its clients on disk but this run does not (state_store changed)")
    else:
        try:
            state.clients = store.restore(record)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{exc}. Copy them back, or delete {path} to run this algorithm and seed again from round 0"
            ) from None
    return state


class Checkpointer:
    """Callback: save the run state after the first trained round, every ``every`` rounds and when
    the run is done. The first save means a run stopped before its first regular checkpoint still
    resumes: its records never outlive their checkpoint."""

    def __init__(self, path: Path, every: int) -> None:
        self.path = path
        self.every = every

    def on_record(self, state: RunState, record: dict) -> None:
        if state.done or state.rounds_done % self.every == 0 or len(state.history) == 1:
            save_checkpoint(self.path, state)


class TraceWriter:
    """Callback: after every training round, save the scored model (``eval_params`` of its stored
    state) of each traced client that has a state, as ``<folder>/<algorithm>-seed<k>/client<i>-round<r>.pt``
    (atomic writes; a resumed run rewrites the same files)."""

    def __init__(self, folder: Path, algorithm: Algorithm, clients: list[int]) -> None:
        self.folder = folder
        self.algorithm = algorithm
        self.clients = clients

    def on_record(self, state: RunState, record: dict) -> None:
        if state.done or not state.rounds_done:
            return
        folder = self.folder / f"{state.algorithm}-seed{state.seed}"
        folder.mkdir(parents=True, exist_ok=True)
        for client in self.clients:
            if client in state.clients:
                params = self.algorithm.eval_params(state.clients[client])
                if isinstance(params, list):  # an ensemble (SosicFL's eval_samples): its first member
                    params = params[0]
                path = folder / f"client{client}-round{state.rounds_done}.pt"
                tmp = path.with_name(path.name + ".tmp")
                with signals_deferred():
                    torch.save({k: v.detach().cpu() for k, v in dict(params).items()}, tmp)
                    os.replace(tmp, path)

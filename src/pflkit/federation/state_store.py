"""Where the clients' states live between their rounds: in memory (a dict) or on disk.

``state_store = "disk"`` keeps each client's state in a file under the results folder, reads it
when the client is sampled and writes it back after its round, with a bounded in-memory cache, so
that memory is bounded by the clients of one round rather than by the number of clients. A
client that never took part has no file: its state is made on first use from the algorithm's
``init_client`` (pure in the initial model and the client id), exactly as the memory store
makes it at the start.

Checkpoints and ``--resume`` use the same files. Every write makes a new version
(``client<i>-v<n>.pt``, written to a temporary name and renamed, so a kill -9 never leaves a torn
file); a checkpoint records each client's current version, and only after the checkpoint is
safely on disk are the versions it no longer needs deleted. A run restored from a checkpoint
deletes the versions written after it (the rounds it will redo), so a resumed run continues from
exactly the states the checkpoint saw.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any, Protocol, overload

import torch

from ..algorithms.base import State
from ..functional import to_device

_FILE = re.compile(r"client(\d+)-v(\d+)\.pt")


class ClientStore(Protocol):
    """Where a run's client states live between rounds (``RunState.clients``): a mapping client id
    -> state that also says what a checkpoint records of it and cleans up once one is written."""

    def __getitem__(self, client: int) -> State: ...

    def __setitem__(self, client: int, state: State) -> None: ...

    def __contains__(self, client: object) -> bool: ...

    def __iter__(self) -> Iterator[int]: ...

    def __len__(self) -> int: ...

    @overload
    def get(self, client: int, /) -> State | None: ...

    @overload
    def get(self, client: int, default: State, /) -> State: ...

    def checkpoint_record(self) -> tuple[dict[int, State], dict[str, Any] | None]:
        """What a checkpoint holds of the clients: (states kept in the checkpoint file, a record of
        states kept elsewhere); everything it names is durable when this returns."""

    def prune(self) -> None:
        """Drop what the last checkpoint does not name (after it is written, or before a fresh start)."""


class MemoryStateStore(dict[int, State]):
    """Every client's state in memory; a checkpoint holds them all."""

    def checkpoint_record(self) -> tuple[dict[int, State], dict[str, Any] | None]:
        return dict(self), None

    def prune(self) -> None:
        pass


class DiskStateStore(MutableMapping[int, State]):
    """A mapping client id -> state backed by one file per client version (see the module text).

    ``make(i)`` creates the state of a client that has none yet (None: a read-only view of the
    clients that have files, as a loaded checkpoint gives); ``cache`` bounds the states kept in
    memory (least recently used are dropped: every state is on disk as soon as it is set).
    """

    def __init__(
        self,
        folder: Path,
        num_clients: int,
        make: Callable[[int], State] | None,
        *,
        cache: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if cache < 1:
            raise ValueError(f"the state cache must hold at least one client (got {cache})")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.num_clients = num_clients
        self.make = make
        self.cache_size = cache
        self.device = device
        self.versions: dict[int, int] = {}  # client -> version of its current file
        self.next_version = 1
        self._cache: OrderedDict[int, State] = OrderedDict()
        self._unsynced: list[Path] = []  # renamed since the last checkpoint, not yet fsync'ed

    def _path(self, client: int, version: int) -> Path:
        return self.folder / f"client{client}-v{version}.pt"

    def _check(self, client: int) -> None:
        if not isinstance(client, int) or not 0 <= client < self.num_clients:
            raise KeyError(client)

    def _remember(self, client: int, state: State) -> None:
        self._cache[client] = state
        self._cache.move_to_end(client)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def __getitem__(self, client: int) -> State:
        self._check(client)
        if client in self._cache:
            self._cache.move_to_end(client)
            return self._cache[client]
        version = self.versions.get(client)
        if version is None:
            if self.make is None:
                raise KeyError(client)
            state = self.make(client)
        else:
            path = self._path(client, version)
            try:
                state = to_device(torch.load(path, map_location="cpu", weights_only=True), self.device)
            except Exception as exc:  # noqa: BLE001 - every unreadable file gets the same clear message
                raise RuntimeError(
                    f"client state file {path} is unreadable ({type(exc).__name__}: {exc}); "
                    "the results folder is damaged"
                ) from exc
        self._remember(client, state)
        return state

    def __setitem__(self, client: int, state: State) -> None:
        self._check(client)
        version, self.next_version = self.next_version, self.next_version + 1
        path = self._path(client, version)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(to_device(state, "cpu"), tmp)
        os.replace(tmp, path)  # atomic: a reader sees the old version or the whole new one
        self._unsynced.append(path)
        self.versions[client] = version
        self._remember(client, state)

    def __delitem__(self, client: int) -> None:
        self._check(client)
        self.versions.pop(client)
        self._cache.pop(client, None)

    def __contains__(self, client: object) -> bool:
        if self.make is None:
            return client in self.versions
        return isinstance(client, int) and 0 <= client < self.num_clients

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.versions) if self.make is None else range(self.num_clients))

    def __len__(self) -> int:
        return len(self.versions) if self.make is None else self.num_clients

    def sync(self) -> None:
        """fsync the files written since the last checkpoint (before the checkpoint names them)."""
        for path in self._unsynced:
            if path.exists():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        self._unsynced.clear()

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint records: each client's current version."""
        return {"versions": dict(self.versions), "next_version": self.next_version}

    def checkpoint_record(self) -> tuple[dict[int, State], dict[str, Any] | None]:
        """No states in the checkpoint file: the versions of the (fsync'ed) files, and the folder."""
        self.sync()
        return {}, {**self.snapshot(), "folder": str(self.folder)}

    def prune(self) -> None:
        """Delete every file that is not a client's current version (after a checkpoint, or on
        restore: versions written after the checkpoint, and torn temporary files)."""
        for path in self.folder.iterdir():
            match = _FILE.fullmatch(path.name)
            if match is None:
                if path.name.endswith(".pt.tmp"):
                    path.unlink()
                continue
            client, version = int(match.group(1)), int(match.group(2))
            if self.versions.get(client) != version:
                path.unlink()

    def restore(self, snapshot: dict[str, Any]) -> DiskStateStore:
        """Continue from a checkpoint's snapshot: its versions, the newer ones deleted."""
        self.versions = {int(k): int(v) for k, v in snapshot["versions"].items()}
        self.next_version = int(snapshot["next_version"])
        self._cache.clear()
        self._unsynced.clear()
        missing = [c for c, v in self.versions.items() if not self._path(c, v).is_file()]
        if missing:
            raise FileNotFoundError(
                f"the checkpoint names client state files that are missing in {self.folder} "
                f"(clients {missing[:5]}{'...' if len(missing) > 5 else ''}): files were deleted "
                "or the results folder was copied without its states/ folder"
            )
        self.prune()
        return self

    @classmethod
    def view(cls, folder: Path, snapshot: dict[str, Any], device: torch.device | str = "cpu") -> DiskStateStore:
        """A read-only view of the clients a checkpoint's snapshot names (reports, tests); a run
        continues instead through its own store's ``restore``."""
        versions = {int(k): int(v) for k, v in snapshot["versions"].items()}
        view = cls(folder, max(versions, default=-1) + 1, None, cache=1, device=device)
        view.versions = versions
        return view

    def bytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob("client*.pt"))

"""Processes that must not outlive the one that started them (the Ray instances pflkit starts).

Ray's processes (GCS, raylet, workers) start their own sessions, so a ``kill -9`` of the process
that started them leaves them running. Each process started inside :func:`reaped` inherits a
marker in its environment (``PFLKIT_REAP``, a space-separated list: blocks nest); a small
watchdog process, in a session of its own, waits for the starter to end and then ends every
process that carries the marker (SIGTERM, then SIGKILL).
Linux only (it reads ``/proc``); elsewhere nothing is watched.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MARKER = "PFLKIT_REAP"

WATCHDOG = r"""
import os, signal, sys, time
parent, marker = int(sys.argv[1]), sys.argv[2].encode()
prefix = b"PFLKIT_REAP="

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")  # a zombie has ended
    except (OSError, IndexError):
        return False

def marked():
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    entries = [e[len(prefix):] for e in f.read().split(b"\0") if e.startswith(prefix)]
                if entries and marker in entries[0].split():
                    yield int(name)
            except OSError:
                pass

while alive(parent):
    time.sleep(0.5)
for sig in (signal.SIGTERM, signal.SIGKILL):
    pids = list(marked())
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    if not pids:
        break
    time.sleep(2)
"""


def marked_processes(marker: str) -> list[int]:
    """The live processes (but this one) whose environment's ``PFLKIT_REAP`` lists ``marker``."""
    prefix, wanted = f"{MARKER}=".encode(), marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            values = [e[len(prefix) :] for e in environ if e.startswith(prefix)]
            if values and wanted in values[0].split():
                found.append(int(entry.name))
    return found


def end_marked(marker: str, wait: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, every process (but this one) marked ``marker``, waiting up to ``wait``
    seconds each time for them to go (what the watchdog does, for a block that ends them itself)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = marked_processes(marker)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.time() + wait
        while set(pids) & set(marked_processes(marker)) and time.time() < deadline:
            time.sleep(0.2)


@contextmanager
def reaped(parent: int | None = None) -> Iterator[str]:
    """Mark the processes started in the block (through the environment they inherit) and end them
    once ``parent`` (default: this process) ends, however it ends; yields the marker. On leaving
    the block the marker is removed and the watchdog stopped (the block's own cleanup, such as
    ``ray.shutdown``, has ended what it started)."""
    if not Path("/proc/self/environ").exists():
        yield ""
        return
    marker = secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    watchdog = subprocess.Popen(
        [sys.executable, "-c", WATCHDOG, str(parent or os.getpid()), marker],
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    previous = os.environ.get(MARKER)
    os.environ[MARKER] = f"{previous} {marker}" if previous else marker
    try:
        yield marker
    finally:
        if previous is None:
            os.environ.pop(MARKER, None)
        else:
            os.environ[MARKER] = previous
        watchdog.terminate()
        watchdog.wait(timeout=10)

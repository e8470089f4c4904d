"""Ctrl-C and SIGTERM: a stopped run ends as ``interrupted`` with its resume command, within
seconds (the engines abandon the clients in flight), and never in the middle of a checkpoint
write; a second signal while it stops aborts the process at once (the last checkpoint stays)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _StopState:
    reason: str | None = None  # why the last stop was requested (reset by each run)
    deferring: int = 0  # depth of the signals_deferred blocks
    pending: str | None = None  # a stop that arrived inside such a block
    cooperative: bool = False  # record the stop only: the loop that runs elsewhere asks stop_reason()


_state = _StopState()


def stop_reason() -> str | None:
    """Why a stop signal arrived since :func:`reset_stop`, or None."""
    return _state.reason


def reset_stop() -> None:
    _state.reason = None
    _state.pending = None


def _request_stop(signum: int, frame: Any) -> None:
    if _state.reason is not None or _state.pending is not None:  # a second signal while stopping: abort now
        sys.stderr.write("\naborted: the run keeps its last checkpoint\n")
        sys.stderr.flush()
        os._exit(130)
        return  # (only where os._exit is replaced, in tests)
    _state.reason = "stopped by SIGTERM" if signum == signal.SIGTERM else "interrupted (Ctrl-C)"
    sys.stderr.write(
        f"\n{_state.reason}: stopping (the clients in flight are abandoned; Ctrl-C again aborts at once)...\n"
    )
    sys.stderr.flush()
    if _state.cooperative:
        return
    if _state.deferring:
        _state.pending = _state.reason
        return
    raise KeyboardInterrupt(_state.reason)


def check_stop() -> None:
    """Raise the stop a signal asked for (KeyboardInterrupt with its reason), where the run's loop
    is not on the main thread (Flower's ServerApp thread): called between its steps."""
    if _state.reason is not None:
        raise KeyboardInterrupt(_state.reason)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def stop_on_signals(cooperative: bool = False) -> Iterator[None]:
    """While the block runs, Ctrl-C and SIGTERM (a scheduler's kill, ``timeout``) stop a run the
    same way: a KeyboardInterrupt whose reason :func:`stop_reason` keeps, so a signal that lands
    inside a library call that turns the KeyboardInterrupt into another error is still known as a
    stop. ``cooperative``: the run's loop is on another thread (Flower's Simulation Engine keeps
    the main one): the signal is recorded only, and that loop raises it (:func:`check_stop`).
    The previous handlers come back afterwards. Main thread only (elsewhere: no change)."""
    if not _main_thread():
        yield
        return
    reset_stop()
    _state.cooperative = cooperative
    previous = {sig: signal.signal(sig, _request_stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        _state.cooperative = False
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold a stop until the block ends: a KeyboardInterrupt raised inside ``torch.save``'s C++
    writer surfaces as an unrelated RuntimeError and leaves a half-written file, so a stop that
    lands while a checkpoint is written is raised right after it. Ctrl-C is held even without
    :func:`stop_on_signals` (SIGTERM then keeps its default: the process ends, and the atomic
    writes leave the previous checkpoint in place)."""
    if not _main_thread():
        yield
        return
    restore = None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        restore = signal.signal(signal.SIGINT, _request_stop)
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
        if restore is not None:
            signal.signal(signal.SIGINT, restore)
        if not _state.deferring and _state.pending is not None:
            reason, _state.pending = _state.pending, None
            raise KeyboardInterrupt(reason)


@contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """Give Ctrl-C's and SIGTERM's handlers back after the block: a library started inside it may
    install its own (``ray.init`` sets a SIGTERM handler that outlives ``ray.shutdown``). Main
    thread only (elsewhere: no change)."""
    if not _main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)

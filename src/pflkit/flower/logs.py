"""Flower's log in a file of the results folder while a simulation runs: the terminal shows pflkit's
own lines (progress, results, errors), ``flower.log`` everything Flower, its database layer
(alembic) and Python's warnings wrote."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the file in the results folder that keeps Flower's full log of a simulation
FLOWER_LOG = "flower.log"


class _PflkitOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name == "pflkit" or record.name.startswith("pflkit.")


@contextmanager
def flower_log_in(path: Path) -> Iterator[None]:
    """For the block: Flower's console handler is off, the root logger's handlers (the terminal)
    pass pflkit's records only, and every record that reaches the root logger, Flower's DEBUG
    lines and Python's warnings included, is appended to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path, mode="a", encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root, flower = logging.getLogger(), logging.getLogger("flwr")
    flower_handlers = [h for h in flower.handlers if not isinstance(h, logging.FileHandler)]
    consoles = list(root.handlers)
    only = _PflkitOnly()
    capturing = getattr(logging, "_warnings_showwarning", None) is not None
    for handler in flower_handlers:
        flower.removeHandler(handler)
    for handler in consoles:
        handler.addFilter(only)
    root.addHandler(to_file)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(capturing)
        root.removeHandler(to_file)
        to_file.close()
        for handler in consoles:
            handler.removeFilter(only)
        for handler in flower_handlers:
            flower.addHandler(handler)


_WRAPPED = re.compile(r"<class '[^']*'>:<'(.*)'>", re.S)
_FLOWER_PREFIX = re.compile(r"^Exception \w+ occurred\. Message: ")


def client_error(reason: str | None) -> str:
    """One line of a client's error as Flower reports it: the message, without Flower's wrapping
    (``<class '...'>:<'...'>``, "Exception ClientAppException occurred") or a traceback's frames."""
    text = (reason or "").strip()
    wrapped = _WRAPPED.fullmatch(text)
    if wrapped:
        text = wrapped.group(1)
    lines = [_FLOWER_PREFIX.sub("", line.strip()) for line in text.splitlines()]
    lines = [line for line in lines if line]
    return lines[-1] if lines else "no reason given"

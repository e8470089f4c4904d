"""Where the repository's files are, seen from the tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

#: the repository's root (tests/support/paths.py is two folders below it)
REPO = Path(__file__).resolve().parents[2]
#: ../shared/datasets/mnist: the MNIST files lent beside the checkout, where there are any
SHARED_MNIST = REPO.parent / "shared" / "datasets" / "mnist"


def load_script(relative: str) -> ModuleType:
    """The repository's script at ``relative`` (a benchmark, a docs generator) as a module."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

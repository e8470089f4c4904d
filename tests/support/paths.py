"""Where the repository's files are, seen from the tests."""

from __future__ import annotations

from pathlib import Path

#: the repository's root (tests/support/paths.py is two folders below it)
REPO = Path(__file__).resolve().parents[2]
#: ../shared/datasets/mnist: the MNIST files lent beside the checkout, where there are any
SHARED_MNIST = REPO.parent / "shared" / "datasets" / "mnist"

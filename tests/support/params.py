"""Parameters of the tests that run every method."""

from __future__ import annotations

import pytest

#: methods whose engine runs take more than about ten seconds each on a two-core CPU (none at the
#: sizes of support.builders.ENGINE_OVERRIDES, which run CReFF's server step small)
SLOW_METHODS: frozenset[str] = frozenset()


def by_method(names) -> list:
    """``names`` as parametrize values, those of SLOW_METHODS marked slow (their ids stay the names)."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_METHODS else name for name in names]

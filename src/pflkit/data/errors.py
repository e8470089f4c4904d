"""Exceptions raised by :mod:`pflkit.data`.

Both derive from :class:`ValueError` so callers that already guard against bad
arguments keep working, while the specific types let them tell a broken data
file apart from an impossible partition request.
"""

from __future__ import annotations

__all__ = ["DataError", "PartitionError"]


class DataError(ValueError):
    """A data file or directory is missing, malformed or inconsistent.

    The message names the offending file or directory and what was expected.
    """


class PartitionError(ValueError):
    """A partition request cannot be satisfied.

    The message names the parameters involved and why they cannot work.
    """

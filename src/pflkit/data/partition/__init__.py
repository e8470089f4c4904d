"""Splitting a labelled pool among clients.

One entry point: :func:`split_clients` (``labels``, :class:`PartitionSpec`, partition seed) gives
every client its training and test indices (:class:`ClientSplit`). Its parts, one module each:

* :mod:`.spec`: :class:`PartitionSpec`, :class:`ClientSplit`, the random conventions and the
  checks and helpers the families share;
* :mod:`.iid`, :mod:`.dirichlet` (PFLlib's ``dir``), :mod:`.pathological` (PFLlib's ``pat``),
  :mod:`.kfold` (SosicFL's k-Fold groups and label Dirichlet): the partition families, whose
  functions (``partition_iid``, ``partition_dirichlet``, ...) stay importable from those modules for
  their tests;
* :mod:`.holdout`: per-client train/test splits and the local test sets of the official-test-set
  protocol (docs/explanations/metrics.md);
* :mod:`.split`: :func:`split_clients`, which picks the family and draws the test data.
"""

from __future__ import annotations

from .holdout import stratified_test_split
from .spec import PARTITION_METHODS, PARTITION_RNGS, ClientSplit, PartitionError, PartitionSpec, class_counts
from .split import split_clients

__all__ = [
    "PARTITION_METHODS",
    "PARTITION_RNGS",
    "ClientSplit",
    "PartitionError",
    "PartitionSpec",
    "class_counts",
    "split_clients",
    "stratified_test_split",
]

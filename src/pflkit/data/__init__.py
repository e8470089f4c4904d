"""Datasets, IDX file I/O and federated partitions (spec §5)."""

from pflkit.data.errors import DataError, PartitionError
from pflkit.data.idx import read_idx, write_idx
from pflkit.data.partition import (
    PARTITION_METHODS,
    class_counts,
    partition,
    partition_dirichlet,
    partition_iid,
    partition_pathological,
    split_train_test,
)
from pflkit.data.sources import DATASETS, Dataset, download_mnist, load_dataset

__all__ = [
    "DATASETS",
    "PARTITION_METHODS",
    "DataError",
    "Dataset",
    "PartitionError",
    "class_counts",
    "download_mnist",
    "load_dataset",
    "partition",
    "partition_dirichlet",
    "partition_iid",
    "partition_pathological",
    "read_idx",
    "split_train_test",
    "write_idx",
]

"""Datasets, IDX file I/O and federated partitions."""

from pflkit.data.agnews import basic_english, build_vocab, load_agnews
from pflkit.data.cifar import load_cifar
from pflkit.data.dataset import Dataset
from pflkit.data.domain_clients import heldout_client_ids, load_domain_clients
from pflkit.data.domain_sets import DOMAIN_DATASETS, DomainOptions, read_domains
from pflkit.data.downloads import (
    download,
    download_agnews,
    download_cifar10,
    download_cifar100,
    download_tiny_imagenet,
)
from pflkit.data.errors import DataError, PartitionError
from pflkit.data.fedprox_synthetic import fedprox_synthetic, generate_synthetic
from pflkit.data.idx import read_idx, write_idx
from pflkit.data.leaf import LEAF_DATASETS, load_leaf
from pflkit.data.natural import ADOPTED_CLIENTS, NATURAL_DATASETS, load_clients
from pflkit.data.partition import PARTITION_METHODS, ClientSplit, PartitionSpec, class_counts, split_clients
from pflkit.data.pfllib import load_pfllib
from pflkit.data.sources import DATASETS, FILE_DATASETS, download_mnist, load_dataset
from pflkit.data.tiny_imagenet import load_tiny_imagenet

__all__ = [
    "ADOPTED_CLIENTS",
    "DATASETS",
    "DOMAIN_DATASETS",
    "LEAF_DATASETS",
    "NATURAL_DATASETS",
    "FILE_DATASETS",
    "PARTITION_METHODS",
    "ClientSplit",
    "PartitionSpec",
    "DataError",
    "Dataset",
    "DomainOptions",
    "PartitionError",
    "basic_english",
    "build_vocab",
    "class_counts",
    "download",
    "download_agnews",
    "download_cifar10",
    "download_cifar100",
    "download_mnist",
    "download_tiny_imagenet",
    "fedprox_synthetic",
    "generate_synthetic",
    "heldout_client_ids",
    "load_agnews",
    "load_cifar",
    "load_clients",
    "load_dataset",
    "load_domain_clients",
    "load_leaf",
    "load_pfllib",
    "load_tiny_imagenet",
    "read_domains",
    "read_idx",
    "split_clients",
    "write_idx",
]

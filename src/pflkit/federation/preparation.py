"""What every run of a config needs before its rounds, wherever it runs (simulator or Flower):
the device, the model skeleton with Theta^0, and the partition of the data."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..config import BaseConfig, ConfigError
from ..data import ADOPTED_CLIENTS, NATURAL_DATASETS, Dataset, load_clients, load_dataset
from ..data.domain_clients import domain_clients
from ..data.domain_sets import DOMAIN_DATASETS, read_domains
from ..data.domains import apply_feature_shift
from ..data.federated import FederatedData
from ..functional import stream_seed
from ..models import UnitModel, buffer_names, build_model, head_names, load_pretrained

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} was requested but CUDA is not available on this machine")
    return device


def initial_params(
    config: BaseConfig, data: FederatedData | tuple[Any, ...], seed: int, device: torch.device
) -> tuple[UnitModel, dict[str, torch.Tensor]]:
    """The config's model skeleton and Theta^0, seeded by the run seed (same for every algorithm).

    ``data`` is a FederatedData or (input shape, number of classes[, vocabulary size])."""
    if isinstance(data, FederatedData):
        shape = tuple(data.input_shape)
    else:
        shape = tuple(data[0])
    return initial_model(config.model_for(shape), data, seed, device, config.pretrained)


def initial_model(
    name: str,
    data: FederatedData | tuple[Any, ...],
    seed: int,
    device: torch.device | str,
    pretrained: str | None = None,
) -> tuple[UnitModel, dict[str, torch.Tensor]]:
    """Model ``name`` for ``data`` and its Theta^0 from the run seed: every run, benchmark and
    Flower node starts from this. Built on the CPU from a seeded generator, Theta^0 is identical on
    every machine with the same PyTorch version, which lets Flower nodes build it locally. Theta^0
    holds the parameters and the floating buffers (batch-norm running statistics) under their
    state-dict names; ``pretrained``: a local state dict of ImageNet weights in torchvision's
    layout (a head of another size stays fresh)."""
    if isinstance(data, FederatedData):
        shape, classes, vocab_size = data.input_shape, data.num_classes, data.vocab_size
    else:
        shape, classes, vocab_size = data[0], data[1], (data[2] if len(data) > 2 else None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(seed, "model-init"))
        model = build_model(name, tuple(shape), classes, vocab_size=vocab_size)
    model = model.to(device)
    buffers = dict(model.named_buffers())
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    init.update({k: buffers[k].detach().clone() for k in buffer_names(model)})
    if pretrained:
        loaded = load_pretrained(model, pretrained, head_names(model.units()))
        init = {k: v.to(device) for k, v in loaded.items()}
    return model, init


def partition_seed(config: BaseConfig, seed: int) -> int:
    """The partition seed of run seed ``seed`` (``partition.seed`` fixes it across seeds)."""
    return config.partition.seed_for(seed)


def partition_dataset(config: BaseConfig, dataset: Dataset, seed: int, device: torch.device | str) -> FederatedData:
    """The config's partition of ``dataset`` for one partition seed (simulator and Flower nodes),
    its clients' images in their domains (``[feature_shift]``); the training batch size sizes
    PFLlib's default minimum client size."""
    data = FederatedData.build(dataset, config.partition, seed, batch_size=config.train.batch_size, device=device)
    return apply_feature_shift(data, config.feature_shift, seed)


def load_pool(config: BaseConfig, data_dir: str | None = None) -> Dataset:
    """The config's dataset as one pool (every dataset but those of ``NATURAL_DATASETS``), read from
    ``data_dir`` (default: the config's)."""
    return load_dataset(
        config.dataset,
        data_dir or config.data_dir,
        official_test=config.partition.official,
        emnist_split=config.data.emnist_split,
    )


def natural_clients(
    config: BaseConfig, seed: int, device: torch.device | str, data_dir: str | None = None
) -> FederatedData:
    """The clients of a dataset that arrives with them (``NATURAL_DATASETS``): read from ``data_dir``
    (default: the config's), or generated from partition seed ``seed`` (fedprox_synthetic)."""
    settings = config.data
    return load_clients(
        config.dataset,
        data_dir or config.data_dir,
        num_clients=config.partition.num_clients,
        seed=seed,
        alpha=settings.synthetic_alpha,
        beta=settings.synthetic_beta,
        iid=settings.synthetic_iid,
        device=device,
        domains=settings.domain_options(),
    )


def build_partitions(config: BaseConfig, device: torch.device) -> tuple[BaseConfig, dict[int, FederatedData]]:
    """One partition per distinct partition seed of the config's seeds, and the config (the client
    count of a dataset with its own clients, a PFLlib or LEAF folder's, replaces ``num_clients``, so
    that the saved config tells the truth)."""
    seeds = {partition_seed(config, s) for s in config.seeds}
    if config.dataset in NATURAL_DATASETS:
        log.info(
            "dataset %s: clients %s; partition, alpha, classes_per_client, balanced, "
            "min_samples_per_client and train_fraction are ignored",
            config.dataset,
            f"of {config.data_dir}" if config.dataset in ADOPTED_CLIENTS else "generated from the partition seed",
        )
    if config.dataset == "fedprox_synthetic":
        return config, {
            s: apply_feature_shift(natural_clients(config, s, device), config.feature_shift, s) for s in sorted(seeds)
        }
    if config.dataset in DOMAIN_DATASETS:  # read once; several clients per domain: split per partition seed
        options = config.data.domain_options()
        assert config.data_dir is not None  # the schema requires it
        splits, classes = read_domains(config.dataset, config.data_dir, options)
        parts = {
            s: apply_feature_shift(
                domain_clients(splits, classes, config.dataset, options, s, device), config.feature_shift, s
            )
            for s in sorted(seeds)
        }
        count = next(iter(parts.values())).num_clients
        if count != config.partition.num_clients:
            log.info("num_clients=%d replaced by the %d clients of the domains", config.partition.num_clients, count)
            config = config.model_copy(update={"partition": config.partition.model_copy(update={"num_clients": count})})
        return config, parts
    if config.dataset in ADOPTED_CLIENTS:
        data = natural_clients(config, 0, device)
        if data.num_clients != config.partition.num_clients:
            log.warning(
                "num_clients=%d replaced by the %d clients of %s",
                config.partition.num_clients,
                data.num_clients,
                config.data_dir,
            )
            config = config.model_copy(
                update={"partition": config.partition.model_copy(update={"num_clients": data.num_clients})}
            )
        try:
            config.check_data_clients(f"{config.data_dir} holds {data.num_clients} clients")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return config, {s: apply_feature_shift(data, config.feature_shift, s) for s in seeds}
    dataset = load_pool(config)
    return config, {s: partition_dataset(config, dataset, s, device) for s in sorted(seeds)}

"""Federated algorithms, one file each, registered by config name."""

from . import apple, ditto, fedamp, fedavg, fedavgc, fedfomo, fedprox, fedproxc, fedrep, local  # noqa: F401
from . import fedphp, partialfed, perfedavg, pfedme  # noqa: F401  (registration side effects)
from .base import (Algorithm, ClientContext, ClientSummary, Payload, Settings, State, TrainSettings,
                   Upload)
from .registry import ALGORITHMS, ALIASES, available, build_algorithm, parse_name, register

__all__ = ["Algorithm", "ClientContext", "ClientSummary", "Payload", "Settings", "State", "TrainSettings",
           "Upload", "ALGORITHMS", "ALIASES", "available", "build_algorithm", "parse_name", "register"]

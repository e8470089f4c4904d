"""Federated algorithms, one file each, registered by config name."""

from . import ditto, fedavg, fedprox, fedrep  # noqa: F401  (registration side effects)
from .base import (Algorithm, ClientContext, ClientSummary, Payload, Settings, State, TrainSettings,
                   Upload)
from .registry import ALGORITHMS, ALIASES, available, build_algorithm, parse_name, register

__all__ = ["Algorithm", "ClientContext", "ClientSummary", "Payload", "Settings", "State", "TrainSettings",
           "Upload", "ALGORITHMS", "ALIASES", "available", "build_algorithm", "parse_name", "register"]

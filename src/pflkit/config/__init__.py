"""Experiment configuration: a TOML file plus dotted ``key=value`` overrides, validated strictly.

A config names the experiment at its top level (``name``, ``dataset``, ``model``, ``algorithms``,
``seeds`` ...); its settings live in sections that are the lower layers' own settings classes:
``[partition]`` is the data layer's :class:`~pflkit.data.PartitionSpec`, ``[train]`` the
algorithms' :class:`~pflkit.algorithms.TrainSettings`, ``[run]`` (:class:`RunSettings`)
what the federation layer reads to execute the rounds. Per-algorithm sections (``[fedprox]``,
``[ditto]``, ``[fedala]`` ...) come from each algorithm's ``settings_class``, so adding an
algorithm adds its section without editing this package.

The flat keys of earlier configs (``lr = 0.05``, ``partition = "pathological"``,
``join_ratio = 0.5`` ...) are aliases, listed once in :data:`FLAT_KEYS`: they are moved into
their sections before validation, and every message names a key as the user wrote it.

The package by job: ``aliases`` (flat keys), ``sections`` ([run], [metrics], [trace]), ``schema``
(the validated model), ``overrides``, ``errors`` (messages), ``loading`` (files, warnings, writing back).
"""

from __future__ import annotations

from typing import Any

from .aliases import FLAT_KEYS, SECTIONS, Written, canonical_path, nest
from .errors import ConfigError, format_errors
from .loading import build_config, describe_keys, load_config, read_toml, resolved, to_dict, unused_keys
from .overrides import apply_override, merge, parse_override, split_overrides
from .schema import BaseConfig, config_model
from .sections import DataSettings, MetricsSettings, RunSettings, TraceSettings

__all__ = [
    "FLAT_KEYS",
    "SECTIONS",
    "Written",
    "canonical_path",
    "nest",
    "ConfigError",
    "format_errors",
    "build_config",
    "describe_keys",
    "load_config",
    "read_toml",
    "resolved",
    "to_dict",
    "unused_keys",
    "apply_override",
    "merge",
    "parse_override",
    "split_overrides",
    "BaseConfig",
    "config_model",
    "MetricsSettings",
    "RunSettings",
    "DataSettings",
    "TraceSettings",
]


def __getattr__(name: str) -> Any:
    if name == "ExperimentConfig":  # the schema of pflkit's own methods
        return config_model()
    raise AttributeError(name)

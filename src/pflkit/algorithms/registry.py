"""Algorithm registry: config names -> classes, and the ``<method>+ala`` composition."""

from __future__ import annotations

from typing import Mapping

from ..models import Units
from .base import Algorithm, Settings, TrainSettings

ALGORITHMS: dict[str, type[Algorithm]] = {}
ALIASES: dict[str, str] = {"fedala": "fedavg+ala"}
ALA_SUFFIX = "+ala"
ALA_SECTION = "fedala"


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator adding an algorithm under ``cls.name``."""
    if not cls.name or cls.name in ALGORITHMS:
        raise ValueError(f"algorithm name {cls.name!r} is empty or already registered")
    ALGORITHMS[cls.name] = cls
    return cls


def parse_name(name: str) -> tuple[str, bool]:
    """``"fedprox+ala"`` -> ("fedprox", True); ``"fedala"`` -> ("fedavg", True)."""
    name = ALIASES.get(name, name)
    with_ala = name.endswith(ALA_SUFFIX)
    base = name[: -len(ALA_SUFFIX)] if with_ala else name
    if base not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(available())}")
    if with_ala and not ALGORITHMS[base].ala_targets:
        raise ValueError(f"{base} downloads no single model that ALA could initialise; {name!r} is undefined")
    return base, with_ala


def available() -> list[str]:
    names = sorted(ALGORITHMS) + sorted(ALIASES)
    names += [f"{n}{ALA_SUFFIX}" for n in sorted(ALGORITHMS) if ALGORITHMS[n].ala_targets]
    return names


def build_algorithm(name: str, sections: Mapping[str, Settings], train: TrainSettings,
                    units: Units) -> Algorithm:
    """Instantiate ``name`` with its config section; ``+ala`` wraps it with ALA (``[fedala]``)."""
    from ..personalize.ala import AdaptiveLocalAggregation, WithALA

    base_name, with_ala = parse_name(name)
    cls = ALGORITHMS[base_name]
    algorithm = cls(sections.get(base_name, cls.settings_class()), train, units)
    if not with_ala:
        return algorithm
    ala = AdaptiveLocalAggregation(sections[ALA_SECTION], units, train)
    return WithALA(algorithm, ala, display_name=name)

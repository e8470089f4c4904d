"""Every method pflkit knows, by name: the registry that configs, engines, Flower nodes, the
benchmarks and the CLI resolve names with.

It holds pflkit's algorithms (``pflkit.algorithms``, one file each) and the plug-ins that modify
them (``pflkit.personalize``: ``<method>+ala`` and the ``fedala`` alias), registered here,
explicitly, as this module is imported; methods outside the package are found by dotted path
(``"mylab.methods:FedPer"``) or by an entry point of the group ``pflkit.methods``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from . import personalize
from .algorithms import Algorithm, Settings, TrainSettings
from .algorithms.registry import ALGORITHMS, ENTRY_POINT_GROUP, Modifier, Registry, Resolved
from .models import Units

REGISTRY = Registry()
for _cls in ALGORITHMS.values():
    REGISTRY.register(_cls)
personalize.register(REGISTRY)


def resolve(name: str) -> Resolved:
    """A method name taken apart (ValueError naming the problem): see ``Registry.resolve``."""
    return REGISTRY.resolve(name)


def method_class(name: str) -> type[Algorithm]:
    """The class of the method ``name`` names (its base, for modified names such as ``fedprox+ala``)."""
    return REGISTRY.resolve(name).cls


def parse_name(name: str) -> tuple[str, list[Modifier]]:
    """``"fedprox+ala"`` -> ("fedprox", [the ALA modifier]); aliases resolved."""
    resolved = REGISTRY.resolve(name)
    return resolved.base, list(resolved.modifiers)


def available() -> list[str]:
    """Every name ``algorithms = [...]`` accepts, but outside classes by dotted path."""
    return REGISTRY.available()


def config_sections(names: Iterable[str] = ()) -> dict[str, type[Settings]]:
    """The config sections of pflkit's methods and modifiers, and of the outside methods among ``names``."""
    return REGISTRY.config_sections(names)


def build_algorithm(name: str, sections: Mapping[str, Settings], train: TrainSettings, units: Units) -> Algorithm:
    """Instantiate the method ``name`` with its config section (modifiers wrap it with theirs)."""
    return REGISTRY.build(name, sections, train, units)


__all__ = [
    "ENTRY_POINT_GROUP",
    "REGISTRY",
    "Registry",
    "Resolved",
    "available",
    "build_algorithm",
    "config_sections",
    "method_class",
    "parse_name",
    "resolve",
]

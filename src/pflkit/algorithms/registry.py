"""Algorithm registry: config names -> classes, and name modifiers such as ``<method>+ala``.

Modules that add to an algorithm (``pflkit.personalize`` adds ALA) register a
:class:`Modifier` here; this package never imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from ..models import Units
from .base import Algorithm, Settings
from .context import TrainSettings

ALGORITHMS: dict[str, type[Algorithm]] = {}
ALIASES: dict[str, str] = {}


@dataclass(frozen=True)
class Modifier:
    """A name suffix that wraps an algorithm (``fedprox+ala``), with its own config section."""

    suffix: str
    section: str
    settings_class: type[Settings]
    applies: Callable[[type[Algorithm]], bool]
    wrap: Callable[[Algorithm, Settings, str], Algorithm]
    refusal: str  # why it does not apply, formatted with {base} and {name}


MODIFIERS: dict[str, Modifier] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator adding an algorithm under ``cls.name``."""
    if not cls.name or cls.name in ALGORITHMS:
        raise ValueError(f"algorithm name {cls.name!r} is empty or already registered")
    ALGORITHMS[cls.name] = cls
    return cls


def register_modifier(modifier: Modifier, aliases: Mapping[str, str] = {}) -> None:
    """Add a name modifier and aliases for names it forms (``fedala`` = ``fedavg+ala``)."""
    MODIFIERS[modifier.suffix] = modifier
    ALIASES.update(aliases)


def parse_name(name: str) -> tuple[str, list[Modifier]]:
    """``"fedprox+ala"`` -> ("fedprox", [the ALA modifier]); aliases resolved."""
    full = ALIASES.get(name, name)
    base, modifiers = full, []
    while True:
        found = next((m for s, m in MODIFIERS.items() if base.endswith(s) and len(base) > len(s)), None)
        if found is None:
            break
        modifiers.insert(0, found)
        base = base[: -len(found.suffix)]
    if base not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(available())}")
    for modifier in modifiers:
        if not modifier.applies(ALGORITHMS[base]):
            raise ValueError(modifier.refusal.format(base=base, name=name))
    return base, modifiers


def available() -> list[str]:
    names = sorted(ALGORITHMS) + sorted(ALIASES)
    for suffix, modifier in MODIFIERS.items():
        names += [f"{n}{suffix}" for n in sorted(ALGORITHMS) if modifier.applies(ALGORITHMS[n])]
    return names


def config_sections() -> dict[str, type[Settings]]:
    """Every config section an algorithm or a modifier owns, by section name."""
    sections: dict[str, type[Settings]] = {cls.section or name: cls.settings_class for name, cls in ALGORITHMS.items()}
    sections.update({m.section: m.settings_class for m in MODIFIERS.values()})
    return sections


def build_algorithm(name: str, sections: Mapping[str, Settings], train: TrainSettings,
                    units: Units) -> Algorithm:
    """Instantiate ``name`` with its config section; modifiers wrap it with theirs."""
    base_name, modifiers = parse_name(name)
    cls = ALGORITHMS[base_name]
    algorithm = cls(sections.get(cls.section or base_name, cls.settings_class()), train, units)
    for modifier in modifiers:
        algorithm = modifier.wrap(algorithm, sections.get(modifier.section, modifier.settings_class()), name)
    return algorithm

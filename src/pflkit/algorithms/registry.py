"""The method registry: config names -> algorithm classes, name modifiers (``<method>+ala``), and
methods that live outside pflkit.

A name in ``algorithms = [...]`` is one of

* a registered method (``"fedavg"``) or alias (``"fedala"``);
* a class in any importable module, by dotted path: ``"mylab.methods:FedPer"``;
* the name of an entry point in the group ``pflkit.methods`` that an installed package declares
  (``[project.entry-points."pflkit.methods"] myfedper = "mylab.methods:FedPer"``);

each optionally followed by modifiers (``"mylab.methods:FedPer+ala"``). A method is a subclass
of :class:`~pflkit.algorithms.base.Algorithm` with a ``name`` (its config section unless it sets
``section``) and a ``settings_class``.

This module holds the :class:`Registry` and the catalogue of pflkit's own algorithms (each module
of this package adds its class with ``@register`` as the package is imported). The registry that
configs, engines and Flower nodes use is ``pflkit.methods.REGISTRY``: the catalogue plus the
plug-ins that modify it (``+ala``), assembled when ``pflkit.methods`` is imported.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import cast

from ..models import Units
from .base import Algorithm, Settings
from .card import MethodCard
from .context import TrainSettings

ENTRY_POINT_GROUP = "pflkit.methods"


@dataclass(frozen=True)
class Modifier:
    """A name suffix that wraps an algorithm (``fedprox+ala``), with its own config section."""

    suffix: str
    section: str
    settings_class: type[Settings]
    applies: Callable[[type[Algorithm]], bool]
    wrap: Callable[[Algorithm, Settings, str], Algorithm]
    refusal: str  # why it does not apply, formatted with {base} and {name}
    reason: Callable[[type[Algorithm]], str | None] | None = None  # a method's own reason, replacing it
    card: MethodCard | None = None  # what the modifier does, for its alias's documentation page


@dataclass(frozen=True)
class Resolved:
    """A method name taken apart: the base class, how the base was written, and the modifiers."""

    cls: type[Algorithm]
    base: str
    modifiers: tuple[Modifier, ...]
    external: bool  # found by dotted path or entry point rather than registered by pflkit

    @property
    def sections(self) -> set[str]:
        """The config sections this method reads."""
        return {section_of(self.cls), *(m.section for m in self.modifiers)}


def section_of(cls: type[Algorithm]) -> str:
    return cls.section or cls.name


class Registry:
    """Methods by name, aliases and modifiers, and the outside methods found by dotted path or
    entry point as configs name them."""

    def __init__(self) -> None:
        self.algorithms: dict[str, type[Algorithm]] = {}
        self.aliases: dict[str, str] = {}
        self.modifiers: dict[str, Modifier] = {}
        self._external: dict[str, type[Algorithm]] = {}
        self._lock = threading.RLock()

    # ---- adding -----------------------------------------------------------------------------
    def register(self, cls: type[Algorithm]) -> type[Algorithm]:
        """Class decorator: add ``cls`` under ``cls.name``."""
        check_method(cls, repr(cls.__name__))
        if self.algorithms.get(cls.name, cls) is not cls:
            raise ValueError(f"algorithm name {cls.name!r} is already registered ({self.algorithms[cls.name]})")
        self.algorithms[cls.name] = cls
        return cls

    def register_modifier(self, modifier: Modifier, aliases: Mapping[str, str] = {}) -> None:
        """Add a name modifier and aliases for names it forms (``fedala`` = ``fedavg+ala``)."""
        self.modifiers[modifier.suffix] = modifier
        self.aliases.update(aliases)

    # ---- looking up -------------------------------------------------------------------------
    def resolve(self, name: str) -> Resolved:
        """``"fedprox+ala"`` -> FedProx with the ALA modifier; ValueError naming the problem."""
        base = self.aliases.get(name, name)
        modifiers: list[Modifier] = []
        while True:
            found = next((m for s, m in self.modifiers.items() if base.endswith(s) and len(base) > len(s)), None)
            if found is None:
                if base in self.aliases:  # an alias that is itself modified (fedala+ala)
                    base = self.aliases[base]
                    continue
                break
            if found in modifiers:
                raise ValueError(f"{name!r} applies {found.suffix} twice; a modifier applies once")
            modifiers.insert(0, found)
            base = base[: -len(found.suffix)]
        cls, external = self._base_class(name, base)
        for modifier in modifiers:
            if not modifier.applies(cls):
                own = modifier.reason(cls) if modifier.reason is not None else None
                raise ValueError(
                    f"{name!r} is undefined: {own}" if own else modifier.refusal.format(base=base, name=name)
                )
        return Resolved(cls, base, tuple(modifiers), external)

    def _base_class(self, name: str, base: str) -> tuple[type[Algorithm], bool]:
        if base in self.algorithms:
            return self.algorithms[base], False
        with self._lock:
            if base not in self._external:
                cls = import_method(base) if ":" in base else self._entry_point(base)
                if cls is None:
                    raise ValueError(
                        f"unknown algorithm {name!r}; available: {', '.join(self.available())} (or a "
                        'class by dotted path, "package.module:Class")'
                    )
                self._check_external(cls, base)
                self._external[base] = cls
            return self._external[base], True

    def _entry_point(self, name: str) -> type[Algorithm] | None:
        found = entry_points(group=ENTRY_POINT_GROUP, name=name)
        if not found:
            return None
        (point, *_) = tuple(found)
        try:
            cls = point.load()
        except Exception as exc:  # an installed plug-in that fails to import: say which
            raise ValueError(
                f"method {name!r} (entry point {point.value!r} of group {ENTRY_POINT_GROUP!r}) "
                f"cannot be loaded: {type(exc).__name__}: {exc}"
            ) from exc
        check_method(cls, f"entry point {name!r} ({point.value})")
        return cls

    def _check_external(self, cls: type[Algorithm], written: str) -> None:
        taken = {section_of(c) for c in self.algorithms.values()} | {m.section for m in self.modifiers.values()}
        if section_of(cls) in taken and self.algorithms.get(cls.name) is not cls:
            raise ValueError(
                f"{written}: its config section [{section_of(cls)}] is already a section of pflkit's "
                "methods; give the class another name (or section)"
            )
        for other, known in self._external.items():
            if known is not cls and section_of(known) == section_of(cls):
                raise ValueError(f"{written} and {other} both use the config section [{section_of(cls)}]")

    def method_class(self, name: str) -> type[Algorithm]:
        return self.resolve(name).cls

    def available(self) -> list[str]:
        """Every registered name, alias and modified name; installed entry points too."""
        names = sorted(self.algorithms) + sorted(self.aliases)
        for suffix, modifier in self.modifiers.items():
            names += [f"{n}{suffix}" for n in sorted(self.algorithms) if modifier.applies(self.algorithms[n])]
        names += sorted(p.name for p in entry_points(group=ENTRY_POINT_GROUP) if p.name not in self.algorithms)
        return names

    def config_sections(self, names: Iterable[str] = ()) -> dict[str, type[Settings]]:
        """Every config section pflkit's methods and modifiers own, by section name, plus those of
        the outside methods among ``names``."""
        sections: dict[str, type[Settings]] = {section_of(cls): cls.settings_class for cls in self.algorithms.values()}
        sections.update({m.section: m.settings_class for m in self.modifiers.values()})
        for name in names:
            resolved = self.resolve(name)
            sections.setdefault(section_of(resolved.cls), resolved.cls.settings_class)
        return sections

    def build(self, name: str, sections: Mapping[str, Settings], train: TrainSettings, units: Units) -> Algorithm:
        """Instantiate ``name`` with its config section; modifiers wrap it with theirs."""
        resolved = self.resolve(name)
        cls = resolved.cls
        algorithm = cls(sections.get(section_of(cls), cls.settings_class()), train, units)
        if resolved.external:
            algorithm.name = resolved.base  # type: ignore[misc]  # records name it as the config does
        for modifier in resolved.modifiers:
            algorithm = modifier.wrap(algorithm, sections.get(modifier.section, modifier.settings_class()), name)
        return algorithm


def check_method(cls: object, written: str) -> None:
    """ValueError unless ``cls`` is an ``Algorithm`` subclass with a name."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ValueError(f"{written} is not a subclass of pflkit.algorithms.Algorithm")
    if not cls.name or not cls.name.isidentifier():
        raise ValueError(
            f'{written} needs a class attribute name = "..." (a Python identifier: it names the '
            f"config section), got {cls.name!r}"
        )
    if not (isinstance(cls.settings_class, type) and issubclass(cls.settings_class, Settings)):
        raise ValueError(f"{written}: settings_class must subclass pflkit.algorithms.Settings")


def import_method(path: str) -> type[Algorithm]:
    """The class at ``"package.module:Class"``; ValueError naming what is missing."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f'{path!r} is not a dotted path of the form "package.module:Class"')
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"method {path!r}: module {module_name!r} cannot be imported ({exc}); is it on PYTHONPATH or installed?"
        ) from exc
    cls = module
    for part in attribute.split("."):
        if not hasattr(cls, part):
            raise ValueError(f"method {path!r}: module {module_name!r} has no {attribute!r}")
        cls = getattr(cls, part)
    check_method(cls, f"method {path!r}")
    return cast(type[Algorithm], cls)  # check_method raised unless it is one


#: pflkit's own algorithms by name, filled as the modules of this package are imported
#: (``pflkit.methods`` builds the registry from it).
ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator of pflkit's algorithm modules: add ``cls`` to the catalogue."""
    check_method(cls, repr(cls.__name__))
    if ALGORITHMS.get(cls.name, cls) is not cls:
        raise ValueError(f"algorithm name {cls.name!r} is already registered ({ALGORITHMS[cls.name]})")
    ALGORITHMS[cls.name] = cls
    return cls

"""The methods a user can name, each with its card and what the code says about it: whether
``+ala`` applies, how the vmap engine runs it, its settings."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from ..algorithms import Algorithm
from ..algorithms.card import MethodCard, card_of, summary_of
from ..algorithms.registry import ENTRY_POINT_GROUP, section_of
from ..engines.batched import BatchedClientContext
from ..methods import REGISTRY

ALA_SUFFIX = "+ala"


@dataclass(frozen=True)
class Entry:
    """One name of the catalogue: the class it builds, its card (None for a card-less method) and
    the facts read off the class."""

    name: str
    cls: type[Algorithm]
    card: MethodCard | None
    sections: tuple[str, ...]  # the config sections it reads, its own first
    ala: bool  # whether ``<name>+ala`` is a method
    vmap: str  # "batched", "batched (step function)" or "one by one"
    vmap_reason: str | None  # why the vmap engine runs its clients one by one
    external: bool

    @property
    def full_name(self) -> str:
        return self.card.full_name if self.card else self.cls.__name__

    @property
    def summary(self) -> str:
        """The card's client round, else the class docstring's first paragraph."""
        return self.card.client_round if self.card else summary_of(self.cls)


def vmap_mode(cls: type[Algorithm], card: MethodCard | None) -> tuple[str, str | None]:
    """How the vmap engine runs the method's clients, from what the class needs of its context
    (models with batch-norm statistics run one by one whatever the method)."""
    missing = set(cls.needs) - BatchedClientContext.provides
    if missing:
        return "one by one", f"its client code needs {', '.join(sorted(missing))} (values read into Python)"
    return ("batched (step function)" if card and card.step_function else "batched"), None


def entry(name: str) -> Entry:
    """The catalogue entry of any name a config accepts (ValueError naming the problem). A
    modified name that is no alias (``fedprox+ala``) is described by its base's entry."""
    resolved = REGISTRY.resolve(name)
    modifiers = resolved.modifiers
    if modifiers and name not in REGISTRY.aliases:
        raise ValueError(f"{name!r} is {resolved.base!r} with {', '.join(m.suffix for m in modifiers)}: see those")
    card = next((m.card for m in modifiers if m.card is not None), None) if modifiers else card_of(resolved.cls)
    ala = REGISTRY.modifiers.get(ALA_SUFFIX)
    can_ala = bool(ala and not modifiers and ala.applies(resolved.cls))
    vmap, reason = vmap_mode(resolved.cls, card_of(resolved.cls))
    sections = (section_of(resolved.cls), *(m.section for m in modifiers))
    return Entry(name, resolved.cls, card, sections, can_ala, vmap, reason, resolved.external)


def names() -> list[str]:
    """Every method and alias (``X+ala`` names aside), then installed outside methods."""
    own = sorted(REGISTRY.algorithms) + sorted(REGISTRY.aliases)
    outside = sorted(p.name for p in entry_points(group=ENTRY_POINT_GROUP) if p.name not in REGISTRY.algorithms)
    return own + outside


def entries() -> tuple[list[Entry], list[str]]:
    """Every entry of ``names()``, and a line for each outside method that cannot be loaded."""
    found, problems = [], []
    for name in names():
        try:
            found.append(entry(name))
        except ValueError as exc:
            problems.append(str(exc))
    return found, problems


def settings_rows(entry: Entry) -> list[tuple[str, Any, str]]:
    """(dotted key, default, description) of every key of the entry's config sections, from the
    settings classes (the source ``pflkit config --keys`` reads)."""
    classes = REGISTRY.config_sections([entry.name])
    rows = []
    for section in entry.sections:
        for key, field in classes[section].model_fields.items():
            rows.append((f"{section}.{key}", field.get_default(call_default_factory=True), field.description or ""))
    return rows

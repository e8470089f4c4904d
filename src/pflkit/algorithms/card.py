"""What a method is, in a form that listings and documentation pages read: its ``MethodCard``.

A method class may set ``card = MethodCard(...)``: the paper, what the client shares and keeps,
the model that is scored, the client round, the reference code it was checked against and the
tests that check it, and what still differs. What the class already states in code (whether
``+ala`` applies, how the vmap engine runs it, its settings) is read from the class, never
written again here. A card is optional: outside methods without one are listed with their
docstring.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Algorithm


@dataclass(frozen=True)
class Paper:
    """Where a method was published. ``authors``: "First et al." (or both names)."""

    title: str | None
    authors: str
    year: int
    venue: str | None = None
    url: str | None = None

    @property
    def short(self) -> str:
        """``McMahan et al., AISTATS 2017``."""
        return f"{self.authors}, {self.venue + ' ' if self.venue else ''}{self.year}"


@dataclass(frozen=True)
class Reference:
    """Code a method was checked against: a GitHub repository at a commit, the files read."""

    repository: str
    commit: str
    files: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repository}/tree/{self.commit}"


@dataclass(frozen=True)
class Choice:
    """A detail the paper leaves open or that pflkit decides: its default and the option that
    changes it (a config key, or "" where there is none)."""

    item: str
    default: str
    option: str = ""


@dataclass(frozen=True)
class MethodCard:
    """A method's description, one fact per sentence.

    ``scored`` is the short name of the model the client's test data scores (``scored_detail``
    says more); ``tests`` are pytest node ids that compare pflkit with the reference code, and
    ``pinned`` the strict xfail tests that pin a recorded difference down.
    """

    full_name: str
    paper: Paper | None
    personalised: bool
    shares: str
    keeps: str
    scored: str
    client_round: str
    scored_detail: str = ""
    references: tuple[Reference, ...] = ()
    no_reference: str | None = None  # why there is no reference code, where there is none
    tests: tuple[str, ...] = ()
    pinned: tuple[str, ...] = ()
    differences: tuple[str, ...] = ()
    choices: tuple[Choice, ...] = ()
    notes: tuple[str, ...] = ()
    reconstruction: bool = False
    ala_initialises: str = "the local model"  # what ``+ala`` blends (where it applies)
    step_function: bool = False  # trains through a pure step function rather than a loss

    def __post_init__(self) -> None:
        if not self.references and not self.no_reference:
            raise ValueError(f"{self.full_name}: a card without reference code must say why (no_reference)")
        for test in (*self.tests, *self.pinned):
            if not test.startswith("tests/") or ".py" not in test:
                raise ValueError(f"{self.full_name}: {test!r} is not a pytest node id (tests/...py::name)")


def card_of(cls: type[Algorithm]) -> MethodCard | None:
    """The card ``cls`` sets itself (a subclass does not inherit its parent's), or None."""
    card = vars(cls).get("card")
    return card if isinstance(card, MethodCard) else None


def summary_of(cls: type[Algorithm]) -> str:
    """The first line of the class's (else its module's) docstring: what a card-less method says."""
    doc = cls.__doc__ or getattr(sys.modules.get(cls.__module__), "__doc__", None) or ""
    return doc.strip().split("\n\n", 1)[0].replace("\n", " ")

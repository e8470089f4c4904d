"""One colour per method in every figure: pflkit's methods in registry order on a fixed qualitative
palette; a modified method (``fedprox+ala``, ``fedala`` = ``fedavg+ala``) in its base's colour,
dashed; an outside method in a colour no pflkit method takes, chosen by a hash of its name."""

from __future__ import annotations

import hashlib
from typing import Any

from matplotlib import colormaps
from matplotlib.colors import to_hex
from matplotlib.ticker import MaxNLocator

#: pflkit's methods in the registry's order (``pflkit.methods.REGISTRY.algorithms``; a test keeps
#: the two equal): a method's place here is its colour
METHODS: tuple[str, ...] = (
    "apple",
    "ditto",
    "fedamp",
    "fedavg",
    "fedavgc",
    "fedfomo",
    "fedprox",
    "fedproxc",
    "fedrep",
    "local",
    "fedphp",
    "partialfed",
    "perfedavg",
    "pfedme",
    "creff",
    "fedacd",
    "feddecorr",
    "fedlc",
    "fednh",
    "fednova",
    "fedntd",
    "fedrod",
    "sosicfl",
    "sosicfl_all",
    "sosicfl_plus",
    "fedper",
    "lgfedavg",
    "fedavgm",
    "fedadagrad",
    "fedadam",
    "fedyogi",
    "feddyn",
    "moon",
    "apfl",
    "fedbabu",
    "scaffold",
    "fedbn",
    "fedproto",
    "fedgh",
    "feddbe",
    "fedcp",
    "fedcac",
    "fedas",
    "fedpac",
    "gpfl",
)
#: the registry's aliases of modified methods, by the base method they modify
ALIASES: dict[str, str] = {"fedala": "fedavg"}

#: tab10, Dark2, the dark and the middle shades of tab20b and of tab20c, then Set1: 47 colours,
#: none of them light
PALETTE: tuple[str, ...] = tuple(
    to_hex(c)
    for c in (
        *colormaps["tab10"].colors,  # type: ignore[attr-defined]  # ListedColormap
        *colormaps["Dark2"].colors,  # type: ignore[attr-defined]
        *colormaps["tab20b"].colors[::4],  # type: ignore[attr-defined]
        *colormaps["tab20b"].colors[1::4],  # type: ignore[attr-defined]
        *colormaps["tab20c"].colors[::4],  # type: ignore[attr-defined]
        *colormaps["tab20c"].colors[1::4],  # type: ignore[attr-defined]
        *colormaps["Set1"].colors,  # type: ignore[attr-defined]
    )
)

#: outside methods' colours (chosen by a hash of the name): the palette's colours no pflkit method
#: takes, then Set2's, so an outside method never looks like one of pflkit's
OUTSIDE: tuple[str, ...] = PALETTE[len(METHODS) :] + tuple(to_hex(c) for c in colormaps["Set2"].colors)  # type: ignore[attr-defined]


def _split(name: str) -> tuple[str, bool]:
    """(the base method's name, whether a modifier such as ``+ala`` applies), from the name alone."""
    base, _, modifiers = name.partition("+")
    if base in ALIASES:
        return ALIASES[base], True
    return base, bool(modifiers)


def method_color(name: str) -> str:
    """The colour of method ``name`` (hex), the same in every figure."""
    base, _ = _split(name)
    if base in METHODS:
        return PALETTE[METHODS.index(base) % len(PALETTE)]
    digest = hashlib.sha256(base.encode()).digest()
    return OUTSIDE[int.from_bytes(digest[:4], "big") % len(OUTSIDE)]


def method_style(name: str) -> dict[str, Any]:
    """Keyword arguments of ``Axes.plot`` for method ``name``: its colour; dashed when modified."""
    return {"color": method_color(name), "linestyle": "--" if _split(name)[1] else "-"}


def integer_ticks(axis: Any) -> None:
    """Whole-number ticks on ``axis`` (an ``ax.xaxis``: rounds, epochs)."""
    axis.set_major_locator(MaxNLocator(integer=True))

"""Every method pflkit knows: the algorithms and the plug-ins that modify them, registered here.

``pflkit.algorithms`` registers its own methods (one file each); plug-ins that wrap any of them
(``pflkit.personalize``: ``<method>+ala`` and the ``fedala`` alias) live beside it, never imported
by it, and are added to the registry here, explicitly. Everything that resolves a method name
(the config schema, the experiment loop, Flower nodes, the benchmarks) imports the registry from
this module, so a name means the same everywhere.
"""

from __future__ import annotations

from . import personalize
from .algorithms import ALGORITHMS, ALIASES, MODIFIERS, available, build_algorithm, config_sections, parse_name

personalize.register()

__all__ = ["ALGORITHMS", "ALIASES", "MODIFIERS", "available", "build_algorithm", "config_sections", "parse_name"]

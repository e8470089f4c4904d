"""Personalisation plug-ins that replace an algorithm's local initialisation (ALA).

``register(registry)`` adds the ``+ala`` name modifier and the ``fedala`` alias to a method
registry; ``pflkit.methods`` calls it for pflkit's (importing this package registers nothing).
"""

from .ala import (
    ALA_MODIFIER,
    ALA_SECTION,
    AdaptiveLocalAggregation,
    ALASettings,
    ALAState,
    WithALA,
    blend,
    clip_weights,
    linear_head_step,
    register,
    weight_update,
)

__all__ = [
    "ALA_MODIFIER",
    "ALA_SECTION",
    "ALASettings",
    "ALAState",
    "AdaptiveLocalAggregation",
    "WithALA",
    "blend",
    "clip_weights",
    "linear_head_step",
    "register",
    "weight_update",
]

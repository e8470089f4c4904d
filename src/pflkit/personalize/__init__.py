"""Personalisation plug-ins that replace an algorithm's local initialisation (ALA).

Importing this package registers the ``+ala`` name modifier and the ``fedala`` alias.
"""

from .ala import (ALA_SECTION, ALASettings, ALAState, AdaptiveLocalAggregation, WithALA, blend, clip_weights,
                  linear_head_step, weight_update)

__all__ = ["ALA_SECTION", "ALASettings", "ALAState", "AdaptiveLocalAggregation", "WithALA", "blend",
           "clip_weights", "linear_head_step", "weight_update"]

"""Personalisation plug-ins that replace an algorithm's local initialisation (ALA)."""

from .ala import ALASettings, AdaptiveLocalAggregation, WithALA, blend, weight_gradient, weight_step

__all__ = ["ALASettings", "AdaptiveLocalAggregation", "WithALA", "blend", "weight_gradient", "weight_step"]

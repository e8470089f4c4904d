"""Model registry: names used in configs -> constructors."""

from __future__ import annotations

from typing import Callable

from .base import (UnitModel, Units, check_no_buffers, count_parameters, head_names,
                   reference_layer_idx, top_unit_names)
from .cnn import DigitsCNN, FedAvgCNN

MODELS: dict[str, Callable[..., UnitModel]] = {
    "fedavg_cnn": FedAvgCNN,
    "digits_cnn": DigitsCNN,
}

DEFAULT_MODEL = {"digits": "digits_cnn", "synthetic": "digits_cnn", "mnist": "fedavg_cnn"}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> UnitModel:
    """Build model ``name`` for inputs of ``input_shape`` ([C, H, W]) and ``num_classes`` outputs."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ValueError(f"model {name!r} expects square images [C, H, H], got input shape {input_shape}")
    model = MODELS[name](in_channels=input_shape[0], num_classes=num_classes, image_size=input_shape[1])
    check_no_buffers(model)
    model.units()  # validates the unit map
    return model


__all__ = ["MODELS", "DEFAULT_MODEL", "build_model", "UnitModel", "Units", "FedAvgCNN", "DigitsCNN",
           "top_unit_names", "head_names", "count_parameters", "reference_layer_idx"]

"""Pure building blocks shared by algorithms: parameter ops, seeded streams, losses, SGD."""

from .params import Params, WeightedSum, clone, equal, message_size, scale, subset, to_device, weighted_average
from .streams import numpy_generator, stream_seed, torch_generator
from .training import (
    SGD,
    Batch,
    Ensemble,
    LossFn,
    Net,
    NonFiniteLossError,
    check_finite,
    classification_loss,
    cross_entropy,
    evaluate,
    forward,
    net_of,
    prediction_logits,
    proximal_loss,
)

__all__ = [
    "Params",
    "clone",
    "equal",
    "message_size",
    "scale",
    "subset",
    "to_device",
    "weighted_average",
    "WeightedSum",
    "numpy_generator",
    "stream_seed",
    "torch_generator",
    "SGD",
    "Batch",
    "Ensemble",
    "LossFn",
    "Net",
    "NonFiniteLossError",
    "check_finite",
    "classification_loss",
    "cross_entropy",
    "evaluate",
    "forward",
    "net_of",
    "prediction_logits",
    "proximal_loss",
]

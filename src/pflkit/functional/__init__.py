"""Pure building blocks shared by algorithms: parameter ops, seeded streams, local SGD."""

from .params import Params, clone, equal, subset, to_device, weighted_average
from .streams import numpy_generator, stream_seed, torch_generator
from .training import NonFiniteLossError, check_finite, evaluate, forward, sgd

__all__ = ["Params", "clone", "equal", "subset", "to_device", "weighted_average",
           "numpy_generator", "stream_seed", "torch_generator", "NonFiniteLossError", "check_finite",
           "evaluate", "forward", "sgd"]

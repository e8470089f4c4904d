"""FedAvg (McMahan et al., AISTATS 2017): overwrite, E epochs of SGD, sample-weighted average.

Everything is the ``Algorithm`` default: ``receive`` overwrites the local model with the global,
``local_train`` minimises cross-entropy, ``aggregate`` averages by sample counts. Evaluated
model: the downloaded global model (spec §2.1), which is the local model right after
``local_init``.
"""

from __future__ import annotations

from .base import Algorithm
from .registry import register


@register
class FedAvg(Algorithm):
    name = "fedavg"

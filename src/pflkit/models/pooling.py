"""2x2 max-pooling without gradients, several times faster than ``F.max_pool2d`` on the CPU.

PyTorch's CPU ``max_pool2d`` forward takes about ten times as long as four strided ``maximum``s
(FedAvgCNN on MNIST: no-grad features and evaluation spent as long pooling as convolving). The
maxima are the same numbers either way (NaN propagates in both), so where no gradient is needed
(ALA's and FedRep's cached features, evaluation) :func:`max_pool_2x2` takes the fast way; training
keeps ``max_pool2d`` and its gradient, which goes to the first maximum of each window (a hand-written
backward with that rule measured no faster than the native one).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F


def max_pool_2x2(x: Tensor) -> Tensor:
    """``F.max_pool2d(x, 2)``: on the CPU and without autograd, as the maximum of the four strided corners."""
    if (
        torch.is_grad_enabled()
        and x.requires_grad
        or x.device.type != "cpu"
        or x.dim() < 3
        or x.shape[-1] % 2
        or x.shape[-2] % 2
    ):
        return F.max_pool2d(x, 2)
    return torch.maximum(
        torch.maximum(x[..., 0::2, 0::2], x[..., 0::2, 1::2]), torch.maximum(x[..., 1::2, 0::2], x[..., 1::2, 1::2])
    )

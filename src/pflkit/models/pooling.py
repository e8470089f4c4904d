"""2x2 max-pooling without gradients, several times faster than ``F.max_pool2d`` on the CPU.

PyTorch's CPU ``max_pool2d`` forward takes about ten times as long as four strided ``maximum``s
(FedAvgCNN on MNIST: no-grad features and evaluation spent as long pooling as convolving). The
maxima are the same numbers either way (NaN propagates in both), so where no gradient is needed
(ALA's and FedRep's cached features, evaluation) :func:`max_pool_2x2` takes the fast way; training
keeps ``max_pool2d`` and its gradient, which goes to the first maximum of each window (a hand-written
backward with that rule measured no faster than the native one), but runs it on a channels-last copy:
its channels-last forward is about ten times faster than the default layout's, and the values and
gradients are the same bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.nn import functional as F


def max_pool_2x2(x: Tensor) -> Tensor:
    """``F.max_pool2d(x, 2)``: on the CPU and without autograd, as the maximum of the four strided
    corners; on the CPU with autograd, in channels-last layout (plain tensors only: vmap cannot)."""
    if x.device.type != "cpu" or x.dim() < 3:
        return F.max_pool2d(x, 2)
    if torch.is_grad_enabled() and x.requires_grad or x.shape[-1] % 2 or x.shape[-2] % 2:
        if x.dim() == 4 and not is_functorch_wrapped_tensor(x):
            return F.max_pool2d(x.contiguous(memory_format=torch.channels_last), 2).contiguous()
        return F.max_pool2d(x, 2)
    return torch.maximum(
        torch.maximum(x[..., 0::2, 0::2], x[..., 0::2, 1::2]), torch.maximum(x[..., 1::2, 0::2], x[..., 1::2, 1::2])
    )

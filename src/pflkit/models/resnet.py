"""ResNet-18 with torchvision's architecture, parameter names and default initialisation.

Written from the ResNet paper's description (He et al., 2016) and torchvision's public layout:
7x7/2 stem convolution (no bias) + batch norm + ReLU + 3x3/2 max pooling, four stages of two
basic blocks (64, 128, 256, 512 channels; stages 2-4 start with stride 2 and a 1x1/2
convolution + batch norm shortcut), global average pooling and a linear classifier.

Batch norm runs with a fixed momentum of 0.1 and without the ``num_batches_tracked`` counter
(torchvision's default momentum makes the counter unused), so the state of a model is its
parameters plus the running means/variances, all floating tensors under torchvision's names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .base import UnitModel

BN_MOMENTUM = 0.1
BN_EPS = 1e-5
STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))  # (channels, stride of the first block)


def batch_norm_module(channels: int, dims: int = 2) -> nn.BatchNorm1d | nn.BatchNorm2d:
    """``nn.BatchNorm2d`` (``dims=1``: ``nn.BatchNorm1d``) without the integer ``num_batches_tracked``
    buffer (fixed momentum)."""
    kind = nn.BatchNorm2d if dims == 2 else nn.BatchNorm1d
    bn = kind(channels, eps=BN_EPS, momentum=BN_MOMENTUM)
    bn.register_buffer("num_batches_tracked", None)
    return bn


def batch_norm(params: Mapping[str, torch.Tensor], name: str, x: torch.Tensor, train: bool) -> torch.Tensor:
    """Batch norm ``name`` as a function of ``params``.

    ``train=True``: normalise with the batch statistics and update ``name.running_mean`` /
    ``name.running_var`` in ``params`` in place (momentum 0.1); ``train=False``: normalise with them.
    """
    return F.batch_norm(
        x,
        params[f"{name}.running_mean"],
        params[f"{name}.running_var"],
        params[f"{name}.weight"],
        params[f"{name}.bias"],
        training=train,
        momentum=BN_MOMENTUM,
        eps=BN_EPS,
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 conv + BN) shortcut."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = batch_norm_module(channels)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = batch_norm_module(channels)
        self.downsample: nn.Sequential | None = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, kernel_size=1, stride=stride, bias=False), batch_norm_module(channels)
            )


def block_forward(
    block: BasicBlock, name: str, params: Mapping[str, torch.Tensor], x: torch.Tensor, train: bool
) -> torch.Tensor:
    out = F.conv2d(x, params[f"{name}.conv1.weight"], stride=block.stride, padding=1)
    out = F.relu(batch_norm(params, f"{name}.bn1", out, train))
    out = F.conv2d(out, params[f"{name}.conv2.weight"], padding=1)
    out = batch_norm(params, f"{name}.bn2", out, train)
    if block.downsample is not None:
        shortcut = F.conv2d(x, params[f"{name}.downsample.0.weight"], stride=block.stride)
        shortcut = batch_norm(params, f"{name}.downsample.1", shortcut, train)
    else:
        shortcut = x
    return F.relu(out + shortcut)


def add_stages(model: nn.Module, block: Callable[[int, int, int], nn.Module]) -> None:
    """The four stages of torchvision's ResNet-18 (two blocks each) as ``layer1``..``layer4``."""
    channels = 64
    for i, (width, stride) in enumerate(STAGES, start=1):
        setattr(model, f"layer{i}", nn.Sequential(block(channels, width, stride), block(width, width, 1)))
        channels = width


def stage_forward(
    model: nn.Module, index: int, x: torch.Tensor, run_block: Callable[[Any, str, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Stage ``index`` (1-4) block by block; after stage 4 the global average pooling, so the head
    sees 512-d features."""
    layer = f"layer{index}"
    for j, block in enumerate(getattr(model, layer)):
        x = run_block(block, f"{layer}.{j}", x)
    if index == 4:
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), -3)
    return x


class ResNet18(UnitModel):
    """torchvision's ``resnet18(weights=None, num_classes=C)`` at native resolution.

    Units: conv1 (= conv1 + bn1, with ReLU and max pooling), layer1, layer2, layer3, layer4 (with
    the global average pooling, so the head sees 512-d features), fc. Batch norm makes the
    lower units non-deterministic in training mode (no ALA feature cache).
    """

    unit_modules = (("conv1", "bn1"), "layer1", "layer2", "layer3", "layer4", "fc")
    prefix_is_deterministic = False
    linear_head = True
    train_mode_aware = True

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 64) -> None:
        super().__init__()
        if image_size < 32:
            raise ValueError(f"ResNet18 needs images of at least 32x32 pixels, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = batch_norm_module(64)
        add_stages(self, BasicBlock)
        self.fc = nn.Linear(512, num_classes)
        for module in self.modules():  # torchvision's default initialisation
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def unit_forward(
        self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor, *, train: bool = False
    ) -> torch.Tensor:
        if index == 0:
            x = F.conv2d(x, params["conv1.weight"], stride=2, padding=3)
            x = F.relu(batch_norm(params, "bn1", x, train))
            return F.max_pool2d(x, kernel_size=3, stride=2, padding=1)
        if index <= 4:
            return stage_forward(self, index, x, lambda block, name, h: block_forward(block, name, params, h, train))
        return F.linear(x, params["fc.weight"], params["fc.bias"])


GN_GROUPS = 2


class GroupNormBlock(nn.Module):
    """``BasicBlock`` with GroupNorm(2, C) in place of every batch norm."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.GroupNorm(GN_GROUPS, channels)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.GroupNorm(GN_GROUPS, channels)
        self.downsample: nn.Sequential | None = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, kernel_size=1, stride=stride, bias=False),
                nn.GroupNorm(GN_GROUPS, channels),
            )


def group_norm(params: Mapping[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    return F.group_norm(x, GN_GROUPS, params[f"{name}.weight"], params[f"{name}.bias"])


def gn_block_forward(
    block: GroupNormBlock, name: str, params: Mapping[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    out = F.relu(
        group_norm(params, f"{name}.bn1", F.conv2d(x, params[f"{name}.conv1.weight"], stride=block.stride, padding=1))
    )
    out = group_norm(params, f"{name}.bn2", F.conv2d(out, params[f"{name}.conv2.weight"], padding=1))
    shortcut = x
    if block.downsample is not None:
        shortcut = group_norm(
            params, f"{name}.downsample.1", F.conv2d(x, params[f"{name}.downsample.0.weight"], stride=block.stride)
        )
    return F.relu(out + shortcut)


class ResNet18GN(UnitModel):
    """The ResNet-18 of FedNH's code (Yutong-Dai/FedNH ``models/ResNet.py``), the lineage of FedACD's
    Tiny-ImageNet model: a 3x3 stride-1 stem convolution without max pooling, GroupNorm(2, C)
    instead of batch norm (no running statistics: it batches on the vmap engine), the four
    stages of torchvision's ResNet-18, global average pooling and a linear classifier (FedNH's
    drops the classifier's bias; pflkit keeps it, as its head-based methods expect one).

    Units: conv1 (= conv1 + bn1 + ReLU), layer1, layer2, layer3, layer4 (with the pooling), fc."""

    unit_modules = (("conv1", "bn1"), "layer1", "layer2", "layer3", "layer4", "fc")
    linear_head = True

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 64) -> None:
        super().__init__()
        if image_size < 8:
            raise ValueError(f"ResNet18GN needs images of at least 8x8 pixels, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.GroupNorm(GN_GROUPS, 64)
        add_stages(self, GroupNormBlock)
        self.fc = nn.Linear(512, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            return F.relu(group_norm(params, "bn1", F.conv2d(x, params["conv1.weight"], padding=1)))
        if index <= 4:
            return stage_forward(self, index, x, lambda block, name, h: gn_block_forward(block, name, params, h))
        return F.linear(x, params["fc.weight"], params["fc.bias"])

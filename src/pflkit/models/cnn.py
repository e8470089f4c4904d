"""Convolutional models of the FedALA family."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from .base import UnitModel
from .pooling import max_pool_2x2
from .resnet import batch_norm, batch_norm_module


def _four_unit_forward(
    model: FedAvgCNN | DigitsCNN, index: int, p: Mapping[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """conv1 -> pool, conv2 -> pool, fc1 (on the flattened maps), fc; ReLU after all but fc.

    The ReLU of a conv unit is applied after its max-pool: ReLU is monotone, so the values and the
    gradients are the ones of ReLU then pool, bit for bit, on a quarter of the elements; pooling
    without gradients takes ``max_pool_2x2``'s faster way to the same numbers."""
    if index == 0:
        return F.relu(max_pool_2x2(F.conv2d(x, p["conv1.weight"], p["conv1.bias"], padding=model.conv1.padding)))
    if index == 1:
        return F.relu(max_pool_2x2(F.conv2d(x, p["conv2.weight"], p["conv2.bias"], padding=model.conv2.padding)))
    if index == 2:
        return F.relu(F.linear(torch.flatten(x, -3), p["fc1.weight"], p["fc1.bias"]))
    return F.linear(x, p["fc.weight"], p["fc.bias"])


def _fedavg_cnn_side(model: nn.Module, image_size: int) -> int:
    """The side of the 4-layer CNN's feature maps after its two 5x5 convolutions and poolings."""
    side = ((image_size - 4) // 2 - 4) // 2
    if side < 1:
        raise ValueError(f"{type(model).__name__} needs images of at least 16x16 pixels, got {image_size}")
    return side


class FedAvgCNN(UnitModel):
    """The 4-layer CNN of McMahan et al. (2017) as used by FedALA/PFLlib.

    conv1(5x5, 32) -> pool -> conv2(5x5, 64) -> pool -> fc1(512) -> fc(C).
    Units: conv1, conv2, fc1, fc.
    """

    unit_modules = ("conv1", "conv2", "fc1", "fc")
    linear_head = True

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        side = _fedavg_cnn_side(self, image_size)
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5)
        self.fc1 = nn.Linear(64 * side * side, 512)
        self.fc = nn.Linear(512, num_classes)

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return _four_unit_forward(self, index, params, x)


class FedAvgCNNBN(UnitModel):
    """FedALA/PFLlib's 4-layer CNN (``fedavg_cnn``) with batch norm after every layer but the
    classifier, as FedBN adds it to its digit CNN: the table's own model plus batch norm, for
    setting FedBN beside methods run on ``fedavg_cnn`` at about the same cost (FedBN's digit CNN
    has 24 times the parameters on 28x28 MNIST: 14.2M against 0.58M).

    conv1(5x5, 32) + bn1 -> ReLU -> pool, conv2(5x5, 64) + bn2 -> ReLU -> pool, fc1(512) + bn3 ->
    ReLU, fc(C). Units: (conv1, bn1), (conv2, bn2), (fc1, bn3), fc. Batch norm uses momentum 0.1.
    """

    unit_modules = (("conv1", "bn1"), ("conv2", "bn2"), ("fc1", "bn3"), "fc")
    prefix_is_deterministic = False
    linear_head = True
    train_mode_aware = True

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        side = _fedavg_cnn_side(self, image_size)
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5)
        self.bn1 = batch_norm_module(32)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5)
        self.bn2 = batch_norm_module(64)
        self.fc1 = nn.Linear(64 * side * side, 512)
        self.bn3 = batch_norm_module(512, dims=1)
        self.fc = nn.Linear(512, num_classes)

    def unit_forward(
        self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor, *, train: bool = False
    ) -> torch.Tensor:
        if index < 2:
            conv, bn = f"conv{index + 1}", f"bn{index + 1}"
            x = F.conv2d(x, params[f"{conv}.weight"], params[f"{conv}.bias"])
            return max_pool_2x2(F.relu(batch_norm(params, bn, x, train)))
        if index == 2:
            x = F.linear(torch.flatten(x, -3), params["fc1.weight"], params["fc1.bias"])
            return F.relu(batch_norm(params, "bn3", x, train))
        return F.linear(x, params["fc.weight"], params["fc.bias"])


class DigitsCNN(UnitModel):
    """A small CNN for 8x8 inputs (scikit-learn digits) with the same four units as FedAvgCNN.

    conv1(3x3, 16, pad 1) -> pool -> conv2(3x3, 32, pad 1) -> pool -> fc1(64) -> fc(C); 13.6k parameters.
    """

    unit_modules = ("conv1", "conv2", "fc1", "fc")
    linear_head = True

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8) -> None:
        super().__init__()
        side = image_size // 4
        if side < 1:
            raise ValueError(f"DigitsCNN needs images of at least 4x4 pixels, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * side * side, 64)
        self.fc = nn.Linear(64, num_classes)

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return _four_unit_forward(self, index, params, x)


class CifarCNN(UnitModel):
    """The simple CIFAR CNN of FedROD/FedNH ("Conv2Cifar"), FedACD's CIFAR model:
    conv(5x5, 64) -> pool -> conv(5x5, 64) -> pool -> fc1(384) -> fc2(192) -> fc(C).
    Units: conv1, conv2, fc1, fc2, fc. ``head_bias=False`` (registered as ``conv2cifar``) drops
    the classifier's bias, as FedNH's code (Yutong-Dai/FedNH ``models/CNN.py``, Conv2Cifar) does."""

    unit_modules = ("conv1", "conv2", "fc1", "fc2", "fc")
    linear_head = True

    def __init__(
        self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32, head_bias: bool = True
    ) -> None:
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"CifarCNN needs images of at least 16x16 pixels, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=5)
        self.conv2 = nn.Conv2d(64, 64, kernel_size=5)
        self.fc1 = nn.Linear(64 * side * side, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc = nn.Linear(192, num_classes, bias=head_bias)

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        p = params
        if index == 0:
            return F.relu(max_pool_2x2(F.conv2d(x, p["conv1.weight"], p["conv1.bias"])))  # see _four_unit_forward
        if index == 1:
            return F.relu(max_pool_2x2(F.conv2d(x, p["conv2.weight"], p["conv2.bias"])))
        if index == 2:
            return F.relu(F.linear(torch.flatten(x, -3), p["fc1.weight"], p["fc1.bias"]))
        if index == 3:
            return F.relu(F.linear(x, p["fc2.weight"], p["fc2.bias"]))
        return F.linear(x, p["fc.weight"], p.get("fc.bias"))


class Conv2Cifar(CifarCNN):
    """FedNH's Conv2Cifar exactly: :class:`CifarCNN` without the classifier's bias (the FedNH /
    FedACD lineage; FedROD's and CReFF's ports in FedNH's code use it too)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> None:
        super().__init__(in_channels, num_classes, image_size, head_bias=False)


class SimpleCNN(UnitModel):
    """SosicFL's SimpleCNN: the "simple CNN (hahn2022connecting)" it cites is SuPerFed's TwoCNN
    (vaseline555/SuPerFed 06860db ``src/models/models.py``, its final version):
    conv(5x5, 32, pad 1) -> pool(2, pad 1) -> conv(5x5, 64, pad 1) -> pool(2, pad 1) -> fc1(200)
    -> fc2(200) -> classifier(C), ReLU between, no biases anywhere. SuPerFed resizes CIFAR-10 to
    28x28 (3136 features); here the flattened size follows the input (4096 for 32x32, 3136 for
    28x28). Units: conv1, conv2, fc1, fc2, classifier (the head SosicFL makes a simplex)."""

    unit_modules = ("conv1", "conv2", "fc1", "fc2", "classifier")
    linear_head = True

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> None:
        super().__init__()
        side = image_size
        for _ in range(2):
            side = (side + 2 - 4) // 2 + 1  # conv 5x5 pad 1, then max-pool 2 with pad 1
        if side < 1:
            raise ValueError(f"SimpleCNN needs images of at least 8x8 pixels, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=1, bias=False)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=1, bias=False)
        self.fc1 = nn.Linear(64 * side * side, 200, bias=False)
        self.fc2 = nn.Linear(200, 200, bias=False)
        self.classifier = nn.Linear(200, num_classes, bias=False)

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        p = params
        if index == 0:
            return F.max_pool2d(F.relu(F.conv2d(x, p["conv1.weight"], padding=1)), 2, padding=1)
        if index == 1:
            return F.max_pool2d(F.relu(F.conv2d(x, p["conv2.weight"], padding=1)), 2, padding=1)
        if index == 2:
            return F.relu(F.linear(torch.flatten(x, -3), p["fc1.weight"]))
        if index == 3:
            return F.relu(F.linear(x, p["fc2.weight"]))
        return F.linear(x, p["classifier.weight"])


class FedBNCNN(UnitModel):
    """FedBN's digit CNN (Li et al., ICLR 2021; med-air/FedBN ``nets/models.py`` ``DigitModel``):
    batch norm after every layer but the classifier.

    conv1(5x5, 64, pad 2) + bn1 -> pool, conv2(5x5, 64, pad 2) + bn2 -> pool, conv3(5x5, 128, pad 2)
    + bn3, fc1(2048) + bn4, fc2(512) + bn5, fc3(C); ReLU after each batch norm. The authors' input is
    3 x 28 x 28 (fc1 sees 6,272 features); here the channels and the side follow the data (side // 4
    after the two poolings). Units: (conv1, bn1), (conv2, bn2), (conv3, bn3), (fc1, bn4), (fc2, bn5),
    fc3. Batch norm uses a fixed momentum of 0.1 (PyTorch's default, the authors' setting).
    """

    unit_modules = (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3"), ("fc1", "bn4"), ("fc2", "bn5"), "fc3")
    prefix_is_deterministic = False
    linear_head = True
    train_mode_aware = True

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        side = image_size // 4
        if side < 1:
            raise ValueError(f"FedBNCNN needs images of at least 4x4 pixels, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 64, 5, 1, 2)
        self.bn1 = batch_norm_module(64)
        self.conv2 = nn.Conv2d(64, 64, 5, 1, 2)
        self.bn2 = batch_norm_module(64)
        self.conv3 = nn.Conv2d(64, 128, 5, 1, 2)
        self.bn3 = batch_norm_module(128)
        self.fc1 = nn.Linear(128 * side * side, 2048)
        self.bn4 = batch_norm_module(2048, dims=1)
        self.fc2 = nn.Linear(2048, 512)
        self.bn5 = batch_norm_module(512, dims=1)
        self.fc3 = nn.Linear(512, num_classes)

    def unit_forward(
        self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor, *, train: bool = False
    ) -> torch.Tensor:
        if index < 3:
            conv, bn = f"conv{index + 1}", f"bn{index + 1}"
            x = F.conv2d(x, params[f"{conv}.weight"], params[f"{conv}.bias"], padding=2)
            x = F.relu(batch_norm(params, bn, x, train))
            return F.max_pool2d(x, 2) if index < 2 else torch.flatten(x, -3)
        if index < 5:
            fc, bn = f"fc{index - 2}", f"bn{index + 1}"
            return F.relu(batch_norm(params, bn, F.linear(x, params[f"{fc}.weight"], params[f"{fc}.bias"]), train))
        return F.linear(x, params["fc3.weight"], params["fc3.bias"])

"""MobileNetV2 and SqueezeNet 1.1 with torchvision's architectures, parameter names and default
initialisation (SosicFL), written from the papers (Sandler et al. 2018; Iandola et al.
2016, v1.1 of the reference implementation) and torchvision's public layout, so that ImageNet
state dicts in torchvision's key layout load with ``load_pretrained``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from .base import UnitModel
from .resnet import batch_norm, batch_norm_module

# (expansion t, channels c, repeats n, stride s) of MobileNetV2's inverted-residual stages
MOBILENET_V2_STAGES = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class _ConvBN(nn.Sequential):
    """torchvision's Conv2dNormActivation: conv (no bias) ``.0``, batch norm ``.1`` (ReLU6 after)."""

    def __init__(self, inp: int, out: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False), batch_norm_module(out)
        )
        self.stride, self.groups, self.padding = stride, groups, (kernel - 1) // 2


class _InvertedResidual(nn.Module):
    def __init__(self, inp: int, out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = inp * expand
        self.use_residual = stride == 1 and inp == out
        layers: list[nn.Module] = [_ConvBN(inp, hidden, kernel=1)] if expand != 1 else []
        layers += [
            _ConvBN(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, out, 1, bias=False),
            batch_norm_module(out),
        ]
        self.conv = nn.Sequential(*layers)


def _conv_bn(
    block: _ConvBN, name: str, params: Mapping[str, torch.Tensor], x: torch.Tensor, train: bool
) -> torch.Tensor:
    x = F.conv2d(x, params[f"{name}.0.weight"], stride=block.stride, padding=block.padding, groups=block.groups)
    return F.relu6(batch_norm(params, f"{name}.1", x, train))


class MobileNetV2(UnitModel):
    """torchvision's ``mobilenet_v2(weights=None, num_classes=C)`` (width 1.0, dropout 0.2 in
    the reference, 0 here by default: pflkit's forwards are deterministic given the parameters).

    Units: features.0 ... features.18 (with the global average pooling in the last), classifier
    (``classifier.1``, the linear head SosicFL makes a simplex)."""

    unit_modules = tuple(f"features.{i}" for i in range(19)) + ("classifier",)
    prefix_is_deterministic = False
    linear_head = True
    train_mode_aware = True

    def __init__(self, in_channels: int = 3, num_classes: int = 1000, image_size: int = 224) -> None:
        super().__init__()
        if image_size < 32:
            raise ValueError(f"MobileNetV2 needs images of at least 32x32 pixels, got {image_size}")
        layers: list[nn.Module] = [_ConvBN(in_channels, 32, stride=2)]
        channels = 32
        for t, c, n, s in MOBILENET_V2_STAGES:
            for i in range(n):
                layers.append(_InvertedResidual(channels, c, s if i == 0 else 1, t))
                channels = c
        layers.append(_ConvBN(channels, 1280, kernel=1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(1280, num_classes))
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def unit_forward(
        self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor, *, train: bool = False
    ) -> torch.Tensor:
        if index == 19:
            return F.linear(x, params["classifier.1.weight"], params["classifier.1.bias"])
        name, block = f"features.{index}", self.features[index]
        if isinstance(block, _ConvBN):
            x = _conv_bn(block, name, params, x, train)
            return torch.flatten(F.adaptive_avg_pool2d(x, 1), -3) if index == 18 else x
        assert isinstance(block, _InvertedResidual)
        out, k = x, 0
        for layer in block.conv:
            if isinstance(layer, _ConvBN):
                out = _conv_bn(layer, f"{name}.conv.{k}", params, out, train)
            elif isinstance(layer, nn.Conv2d):
                out = F.conv2d(out, params[f"{name}.conv.{k}.weight"])
            else:
                out = batch_norm(params, f"{name}.conv.{k}", out, train)
            k += 1
        return x + out if block.use_residual else out


class _Fire(nn.Module):
    def __init__(self, inp: int, squeeze: int, expand1: int, expand3: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(inp, squeeze, 1)
        self.expand1x1 = nn.Conv2d(squeeze, expand1, 1)
        self.expand3x3 = nn.Conv2d(squeeze, expand3, 3, padding=1)


# SqueezeNet 1.1's features: conv, pool, fire, fire, pool, fire, fire, pool, fire x 4
_SQUEEZE_FIRES = {
    3: (64, 16, 64, 64),
    4: (128, 16, 64, 64),
    6: (128, 32, 128, 128),
    7: (256, 32, 128, 128),
    9: (256, 48, 192, 192),
    10: (384, 48, 192, 192),
    11: (384, 64, 256, 256),
    12: (512, 64, 256, 256),
}


class SqueezeNet(UnitModel):
    """torchvision's ``squeezenet1_1(weights=None, num_classes=C)`` (dropout 0.5 in the reference,
    0 here by default). Units: features.0 (the first conv, with its pooling), each Fire module
    (features.3, .4, .6, .7, .9, .10, .11, .12; pooling after .4 and .7 belongs to them), and the
    head ``classifier.1``, a 1x1 convolution followed by ReLU and global average pooling (the
    simplex layer of SosicFL)."""

    unit_modules = ("features.0", *(f"features.{i}" for i in _SQUEEZE_FIRES), "classifier")
    linear_head = False

    def __init__(self, in_channels: int = 3, num_classes: int = 1000, image_size: int = 224) -> None:
        super().__init__()
        if image_size < 32:
            raise ValueError(f"SqueezeNet needs images of at least 32x32 pixels, got {image_size}")
        layers: list[nn.Module] = [nn.Conv2d(in_channels, 64, 3, stride=2)]
        for i in range(1, 13):
            layers.append(_Fire(*_SQUEEZE_FIRES[i]) if i in _SQUEEZE_FIRES else nn.Identity())
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Conv2d(512, num_classes, 1))
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                if m is self.classifier[1]:
                    nn.init.normal_(m.weight, 0.0, 0.01)
                else:
                    nn.init.kaiming_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        pool = lambda t: F.max_pool2d(t, 3, 2, ceil_mode=True)  # noqa: E731
        if index == 0:
            return pool(F.relu(F.conv2d(x, params["features.0.weight"], params["features.0.bias"], stride=2)))
        if index == len(self.unit_modules) - 1:
            x = F.relu(F.conv2d(x, params["classifier.1.weight"], params["classifier.1.bias"]))
            return torch.flatten(F.adaptive_avg_pool2d(x, 1), -3)
        i = list(_SQUEEZE_FIRES)[index - 1]
        p = f"features.{i}"
        s = F.relu(F.conv2d(x, params[f"{p}.squeeze.weight"], params[f"{p}.squeeze.bias"]))
        x = torch.cat(
            [
                F.relu(F.conv2d(s, params[f"{p}.expand1x1.weight"], params[f"{p}.expand1x1.bias"])),
                F.relu(F.conv2d(s, params[f"{p}.expand3x3.weight"], params[f"{p}.expand3x3.bias"], padding=1)),
            ],
            -3,
        )
        return pool(x) if i in (4, 7) else x


def load_pretrained(model: nn.Module, path: str, head: list[str]) -> dict[str, torch.Tensor]:
    """The model's parameters and batch-norm statistics from a local state dict in torchvision's
    key layout (e.g. ImageNet weights saved with ``torch.save(model.state_dict(), path)``); the
    ``head`` entries keep their fresh initialisation when their shapes differ (another number of
    classes). Missing keys, unexpected shapes or an unreadable file are errors naming them."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"pretrained = {path!r}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ValueError(f"pretrained = {path!r} is not a readable PyTorch state dict ({type(exc).__name__})") from None
    if not isinstance(state, Mapping):
        raise ValueError(f"pretrained = {path!r} holds a {type(state).__name__}, not a state dict")
    own = {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers() if b.is_floating_point()}}
    missing = [k for k in own if k not in state and k not in head]
    if missing:
        raise ValueError(
            f"pretrained = {path!r} does not fit {type(model).__name__}: missing {len(missing)} keys "
            f"(e.g. {', '.join(missing[:3])})"
        )
    out = {}
    for name, value in own.items():
        loaded = state.get(name)
        if loaded is None or (name in head and tuple(loaded.shape) != tuple(value.shape)):
            out[name] = value.detach().clone()
            continue
        if tuple(loaded.shape) != tuple(value.shape):
            raise ValueError(
                f"pretrained = {path!r} does not fit {type(model).__name__}: {name} has shape "
                f"{tuple(loaded.shape)}, the model expects {tuple(value.shape)}"
            )
        out[name] = loaded.detach().to(value.dtype).clone()
    return out

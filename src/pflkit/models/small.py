"""Small models of the LEAF/FedProx/pFedMe settings: multinomial logistic regression, the two-layer
DNN, LEAF's character LSTM and LeNet-5.

``Mclr`` and ``DNN`` flatten any input (feature vectors [D] or images [C, H, W]); they return
logits (pFedMe's modules end in ``log_softmax``, which cross-entropy makes redundant: the losses
and predictions are the same).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from .base import UnitModel
from .pooling import max_pool_2x2

__all__ = ["DNN", "CharLSTM", "LeNet5", "Mclr"]


def _features(input_shape: tuple[int, ...]) -> int:
    size = math.prod(int(d) for d in input_shape)
    if size < 1:
        raise ValueError(f"expected inputs of at least one feature, got input shape {tuple(input_shape)}")
    return size


class Mclr(UnitModel):
    """Multinomial logistic regression (pFedMe's ``Mclr_Logistic``, FedProx's ``mclr``):
    flatten -> fc Linear(D, C). One unit: fc (exactly ``F.linear``, ``linear_head``, on feature
    vectors; on images it also flattens)."""

    unit_modules = ("fc",)
    input_kind = "features"

    def __init__(self, input_shape: tuple[int, ...] = (60,), num_classes: int = 10) -> None:
        super().__init__()
        self.input_dims = len(input_shape)
        self.linear_head = self.input_dims == 1
        self.fc = nn.Linear(_features(input_shape), num_classes)

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.flatten(-self.input_dims), params["fc.weight"], params["fc.bias"])


class DNN(UnitModel):
    """pFedMe's two-layer ``DNN``: flatten -> fc1 Linear(D, hidden) -> ReLU -> fc Linear(hidden, C).

    ``hidden=None`` is pFedMe's choice: 20 for its 60-feature Synthetic data, 100 otherwise (MNIST).
    Units: fc1, fc.
    """

    unit_modules = ("fc1", "fc")
    linear_head = True
    input_kind = "features"

    def __init__(self, input_shape: tuple[int, ...] = (784,), num_classes: int = 10, hidden: int | None = None) -> None:
        super().__init__()
        features = _features(input_shape)
        hidden = (20 if features == 60 else 100) if hidden is None else hidden
        self.input_dims = len(input_shape)
        self.fc1 = nn.Linear(features, hidden)
        self.fc = nn.Linear(hidden, num_classes)

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            return F.relu(F.linear(x.flatten(-self.input_dims), params["fc1.weight"], params["fc1.bias"]))
        return F.linear(x, params["fc.weight"], params["fc.bias"])


def lstm_layer(
    x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor, b_hh: torch.Tensor
) -> torch.Tensor:
    """One LSTM layer over the sequence ``x`` [..., L, d] from zero states, PyTorch's parameterisation
    (gates i, f, g, o; two biases): every hidden state, [..., L, hidden]. A pure function of its
    parameters (vmappable), equal to ``nn.LSTM``'s output."""
    hidden = w_hh.shape[-1]
    inputs = F.linear(x, w_ih, b_ih).unbind(-2)  # the input projection of every step at once
    h = torch.zeros_like(inputs[0][..., :hidden])
    c = h
    out = []
    for step in inputs:
        i, f, g, o = (step + F.linear(h, w_hh, b_hh)).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        out.append(h)
    return torch.stack(out, -2)


class CharLSTM(UnitModel):
    """LEAF's Shakespeare next-character model: embedding (vocab x 8) -> LSTM(256) -> LSTM(256) ->
    fc Linear(256, C) on the last step's output. Input: int64 character ids [n, L].
    Units: embedding, lstm1, lstm2, fc.
    """

    unit_modules = ("embedding", "lstm1", "lstm2", "fc")
    linear_head = True
    input_kind = "tokens"

    def __init__(
        self, vocab_size: int = 80, num_classes: int = 80, seq_len: int | None = None, embed: int = 8, hidden: int = 256
    ) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"CharLSTM needs a vocabulary of at least one symbol, got {vocab_size}")
        if seq_len is not None and seq_len < 1:
            raise ValueError(f"CharLSTM needs sequences of at least one symbol, got length {seq_len}")
        self.embedding = nn.Embedding(vocab_size, embed)
        self.lstm1 = nn.LSTM(embed, hidden, batch_first=True)
        self.lstm2 = nn.LSTM(hidden, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            return F.embedding(x, params["embedding.weight"])
        if index in (1, 2):
            name = f"lstm{index}"
            weights = [params[f"{name}.{kind}_l0"] for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
            states = lstm_layer(x, *weights)
            return states if index == 1 else states.select(-2, -1)  # lstm2: the last step's output
        return F.linear(x, params["fc.weight"], params["fc.bias"])


class LeNet5(UnitModel):
    """LeNet-5 (LeCun et al. 1998) with ReLU and max-pooling: conv1(5x5, 6) -> pool -> conv2(5x5, 16)
    -> pool -> fc1(120) -> fc2(84) -> fc(C). 28x28 images are padded by 2 (the 32x32 of the
    original). Units: conv1, conv2, fc1, fc2, fc.
    """

    unit_modules = ("conv1", "conv2", "fc1", "fc2", "fc")
    linear_head = True

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        pad = 2 if image_size == 28 else 0
        side = ((image_size + 2 * pad - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"LeNet-5 needs images of at least 16x16 pixels, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 6, kernel_size=5, padding=pad)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc = nn.Linear(84, num_classes)

    def unit_forward(self, index: int, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if index in (0, 1):
            name = f"conv{index + 1}"
            conv = F.conv2d(x, params[f"{name}.weight"], params[f"{name}.bias"], padding=getattr(self, name).padding)
            return F.relu(max_pool_2x2(conv))  # ReLU and max-pooling commute
        if index == 2:
            return F.relu(F.linear(torch.flatten(x, -3), params["fc1.weight"], params["fc1.bias"]))
        if index == 3:
            return F.relu(F.linear(x, params["fc2.weight"], params["fc2.bias"]))
        return F.linear(x, params["fc.weight"], params["fc.bias"])

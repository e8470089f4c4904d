"""Model registry: names used in configs -> constructors."""

from __future__ import annotations

from collections.abc import Callable

from .base import (
    UnitModel,
    Units,
    buffer_names,
    check_buffers,
    count_parameters,
    head_names,
    norm_layers,
    num_outputs,
    parameter_names,
    reference_layer_idx,
    statistic_entries,
    top_unit_names,
)
from .cnn import CifarCNN, Conv2Cifar, DigitsCNN, FedAvgCNN, FedAvgCNNBN, FedBNCNN, SimpleCNN
from .mobile import MobileNetV2, SqueezeNet, load_pretrained
from .resnet import ResNet18, ResNet18GN
from .small import DNN, CharLSTM, LeNet5, Mclr
from .text import FastText

MODELS: dict[str, Callable[..., UnitModel]] = {
    "fedavg_cnn": FedAvgCNN,
    "fedavg_cnn_bn": FedAvgCNNBN,
    "digits_cnn": DigitsCNN,
    "cifar_cnn": CifarCNN,
    "conv2cifar": Conv2Cifar,
    "simple_cnn": SimpleCNN,
    "fedbn_cnn": FedBNCNN,
    "resnet18": ResNet18,
    "resnet18_gn": ResNet18GN,
    "mobilenet_v2": MobileNetV2,
    "squeezenet1_1": SqueezeNet,
    "fasttext": FastText,
    "mclr": Mclr,
    "dnn": DNN,
    "char_lstm": CharLSTM,
    "lenet5": LeNet5,
}

# pfllib and leaf are absent on purpose: its model depends on the imported data (BaseConfig.model_for).
DEFAULT_MODEL = {
    "digits": "digits_cnn",
    "synthetic": "digits_cnn",
    "mnist": "fedavg_cnn",
    "cifar10": "fedavg_cnn",
    "cifar100": "fedavg_cnn",
    "tiny_imagenet": "fedavg_cnn",
    "agnews": "fasttext",
    "fashion_mnist": "fedavg_cnn",
    "emnist": "fedavg_cnn",
    "svhn": "fedavg_cnn",
    "usps": "fedavg_cnn",
    "cinic10": "fedavg_cnn",
    "femnist": "fedavg_cnn",
    "shakespeare": "char_lstm",
    "sent140": "fasttext",
    "fedprox_synthetic": "mclr",
    "digit5": "fedbn_cnn",
    "office_caltech10": "resnet18",
    "domainnet": "resnet18",
}


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, *, vocab_size: int | None = None
) -> UnitModel:
    """Build model ``name`` for inputs of ``input_shape`` and ``num_classes`` outputs.

    Image models take square images [C, H, H]; token models (fasttext, char_lstm) take token ids
    of shape [L] and need ``vocab_size`` (ignored by image models); feature models (mclr, dnn)
    flatten inputs of any shape.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    constructor = MODELS[name]
    shape = tuple(int(d) for d in input_shape)
    if getattr(constructor, "input_kind", "image") == "tokens":
        if len(shape) != 1:
            raise ValueError(f"model {name!r} expects token-id sequences of shape [L], got input shape {shape}")
        if vocab_size is None:
            raise ValueError(
                f"model {name!r} needs the vocabulary size (vocab_size) of the dataset; "
                "it is only available for text datasets"
            )
        model = constructor(vocab_size=int(vocab_size), num_classes=num_classes, seq_len=shape[0])
    elif getattr(constructor, "input_kind", "image") == "features":
        model = constructor(input_shape=shape, num_classes=num_classes)
    else:
        if len(shape) != 3 or shape[1] != shape[2]:
            raise ValueError(f"model {name!r} expects square images [C, H, H], got input shape {shape}")
        model = constructor(in_channels=shape[0], num_classes=num_classes, image_size=shape[1])
    check_buffers(model)
    model.units()  # validates the unit map
    return model


__all__ = [
    "MODELS",
    "DEFAULT_MODEL",
    "build_model",
    "UnitModel",
    "Units",
    "FedAvgCNN",
    "DigitsCNN",
    "CifarCNN",
    "Conv2Cifar",
    "SimpleCNN",
    "FedBNCNN",
    "ResNet18",
    "ResNet18GN",
    "MobileNetV2",
    "SqueezeNet",
    "load_pretrained",
    "FastText",
    "Mclr",
    "DNN",
    "CharLSTM",
    "LeNet5",
    "buffer_names",
    "norm_layers",
    "num_outputs",
    "parameter_names",
    "top_unit_names",
    "head_names",
    "count_parameters",
    "reference_layer_idx",
    "statistic_entries",
]

"""The small models (mclr, dnn, char_lstm, lenet5): shapes, units, their pure unit functions against
the modules and against transcriptions of pFedMe's and LEAF's models, and the vmap engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms import TrainSettings
from pflkit.config import load_config
from pflkit.data.federated import ClientData, FederatedData
from pflkit.engines import LoopEngine, VmapEngine
from pflkit.engines.base import RoundSetup
from pflkit.methods import build_algorithm
from pflkit.models import MODELS, build_model, count_parameters
from tests.support.builders import simulate_rounds
from tests.support.checks import assert_states_close

torch.set_num_threads(1)

# name, input shape, classes, vocabulary, units, parameters
CASES = [
    ("mclr", (60,), 10, None, ["fc"], 610),
    ("mclr", (1, 28, 28), 10, None, ["fc"], 7_850),
    ("dnn", (60,), 10, None, ["fc1", "fc"], 60 * 20 + 20 + 20 * 10 + 10),  # pFedMe's DNN(60, 20, 10)
    ("dnn", (1, 28, 28), 10, None, ["fc1", "fc"], 784 * 100 + 100 + 100 * 10 + 10),  # DNN(784, 100, 10)
    ("char_lstm", (80,), 80, 80, ["embedding", "lstm1", "lstm2", "fc"], None),
    ("lenet5", (1, 28, 28), 10, None, ["conv1", "conv2", "fc1", "fc2", "fc"], 61_706),
    ("lenet5", (3, 32, 32), 10, None, ["conv1", "conv2", "fc1", "fc2", "fc"], 62_006),
]


def inputs(shape: tuple[int, ...], vocab: int | None, n: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (n, *shape), generator=g) if vocab else torch.randn(n, *shape, generator=g)


@pytest.mark.parametrize(("name", "shape", "classes", "vocab", "units", "count"), CASES)
def test_shapes_units_and_forward_is_apply_units(name, shape, classes, vocab, units, count) -> None:
    assert name in MODELS
    torch.manual_seed(0)
    model = build_model(name, shape, classes, vocab_size=vocab)
    assert [u for u, _ in model.units()] == units
    if count is not None:
        assert count_parameters(model) == count
    x = inputs(shape, vocab)
    out = model(x)
    assert out.shape == (3, classes)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert torch.equal(model.apply_units(params, x), out.detach())
    assert model.linear_head == (name != "mclr" or len(shape) == 1)  # the head is F.linear on its input
    if model.linear_head:
        middle = model.apply_units(params, x, 0, len(units) - 1)
        assert torch.equal(F.linear(middle, params["fc.weight"], params["fc.bias"]), out.detach())


def test_char_lstm_is_leafs_stacked_lstm() -> None:
    """LEAF: embedding 8 -> 2-layer LSTM 256 -> dense on the last output; here against nn.LSTM(num_layers=2)."""
    torch.manual_seed(1)
    model = build_model("char_lstm", (80,), 80, vocab_size=80)
    reference = nn.LSTM(8, 256, num_layers=2, batch_first=True)
    with torch.no_grad():
        for layer, own in ((0, model.lstm1), (1, model.lstm2)):
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(reference, f"{kind}_l{layer}").copy_(getattr(own, f"{kind}_l0"))
    x = inputs((80,), 80, n=4)
    states, _ = reference(model.embedding(x))
    expected = model.fc(states[:, -1])
    assert torch.allclose(model(x), expected, atol=1e-5)
    assert model.embedding.weight.shape == (80, 8) and model.fc.in_features == 256


def test_mclr_and_dnn_are_pfedmes_modules_up_to_log_softmax() -> None:
    """pFedMe's Mclr_Logistic and DNN end in log_softmax: the same log-probabilities as ours."""
    torch.manual_seed(2)
    mclr, dnn = build_model("mclr", (1, 28, 28), 10), build_model("dnn", (1, 28, 28), 10)
    x = torch.randn(5, 1, 28, 28)
    flat = torch.flatten(x, 1)
    theirs_mclr = F.log_softmax(F.linear(flat, mclr.fc.weight, mclr.fc.bias), dim=1)
    theirs_dnn = F.log_softmax(dnn.fc(F.relu(dnn.fc1(flat))), dim=1)
    assert torch.allclose(F.log_softmax(mclr(x), 1), theirs_mclr, atol=1e-6)
    assert torch.allclose(F.log_softmax(dnn(x), 1), theirs_dnn, atol=1e-6)


def test_small_models_refuse_inputs_they_cannot_take() -> None:
    with pytest.raises(ValueError, match="at least 16x16"):
        build_model("lenet5", (1, 8, 8), 10)
    with pytest.raises(ValueError, match="needs the vocabulary size"):
        build_model("char_lstm", (80,), 80)
    with pytest.raises(ValueError, match="token-id sequences"):
        build_model("char_lstm", (1, 28, 28), 80, vocab_size=80)


def char_data(sizes: list[int], length: int = 6, vocab: int = 12) -> FederatedData:
    g = torch.Generator().manual_seed(0)
    clients = []
    for i, n in enumerate(sizes):
        x = torch.randint(0, vocab, (n + 3, length), generator=g)
        y = (x[:, -1] + 1) % vocab  # the next character follows the last
        clients.append(ClientData(i, x[:n], y[:n], x[n:], y[n:]))
    return FederatedData.from_clients(clients, vocab, "toy-chars", vocab_size=vocab)


@pytest.mark.parametrize("name", ["fedavg", "fedala"])
def test_char_lstm_loop_and_vmap_engines_agree(name: str) -> None:
    data = char_data([9, 7, 5])
    cfg = load_config(None, ["fedala.max_start_epochs=2"])

    def run(engine):
        torch.manual_seed(0)
        model = build_model("char_lstm", data.input_shape, data.num_classes, vocab_size=data.vocab_size)
        init = {k: v.detach().clone() for k, v in model.named_parameters()}
        train = TrainSettings(batch_size=4, local_epochs=1, lr=0.5)
        alg = build_algorithm(name, cfg.algorithm_sections(), train, model.units())
        return simulate_rounds(RoundSetup(alg, data, model, model.units(), train, seed=3), engine, init, 2)

    assert_states_close(run(LoopEngine()), run(VmapEngine(chunk_size=2)), 1e-4)


class DigitModelTranscribed(nn.Module):
    """FedBN's ``DigitModel`` (med-air/FedBN 2fa38ad, ``nets/models.py``), transcribed."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 5, 1, 2)
        self.bn1 = nn.BatchNorm2d(64)
        self.conv2 = nn.Conv2d(64, 64, 5, 1, 2)
        self.bn2 = nn.BatchNorm2d(64)
        self.conv3 = nn.Conv2d(64, 128, 5, 1, 2)
        self.bn3 = nn.BatchNorm2d(128)
        self.fc1 = nn.Linear(6272, 2048)
        self.bn4 = nn.BatchNorm1d(2048)
        self.fc2 = nn.Linear(2048, 512)
        self.bn5 = nn.BatchNorm1d(512)
        self.fc3 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.relu(self.bn3(self.conv3(x))).view(x.shape[0], -1)
        x = F.relu(self.bn5(self.fc2(F.relu(self.bn4(self.fc1(x))))))
        return self.fc3(x)


def test_fedbn_cnn_is_fedbns_digit_model_on_its_3x28x28_digits() -> None:
    """Same tensors in the same order (parameters and batch-norm statistics; ``num_batches_tracked``,
    unused at momentum 0.1, is not kept), and the same outputs in training mode (batch statistics,
    then the updated running statistics) and in evaluation mode."""
    torch.manual_seed(0)
    ours = build_model("fedbn_cnn", (3, 28, 28), 10)
    theirs = DigitModelTranscribed()
    kept = {k: v for k, v in theirs.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [(k, v.shape) for k, v in kept.items()]
    assert count_parameters(ours) == sum(p.numel() for p in theirs.parameters())
    theirs.load_state_dict(ours.state_dict(), strict=False)
    x = inputs((3, 28, 28), None, n=6)
    ours.train(), theirs.train()
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(v, theirs.state_dict()[k], atol=1e-6, rtol=1e-5)
    ours.eval(), theirs.eval()
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)

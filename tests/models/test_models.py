"""Models against their references (docs/explanations/reconstructions.md) and batch-norm buffers end to end."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms import TrainSettings
from pflkit.config import load_config
from pflkit.data.federated import ClientData, FederatedData
from pflkit.engines import LoopEngine, ParallelEngine, RoundSetup, SingleClientContext, VmapEngine
from pflkit.federation import initial_params
from pflkit.functional import evaluate, forward
from pflkit.methods import available, build_algorithm
from pflkit.models import (
    MODELS,
    buffer_names,
    build_model,
    count_parameters,
    reference_layer_idx,
    top_unit_names,
)
from pflkit.models.base import check_buffers
from pflkit.personalize import AdaptiveLocalAggregation, ALASettings
from tests.support.builders import fit_on, simulate_rounds
from tests.support.checks import assert_states_close

torch.set_num_threads(1)

RESNET_COUNTS = [5_130, 8_398_858, 10_498_570, 11_024_138, 11_172_106, 11_181_642]
FASTTEXT_COUNTS = [132, 1_188, 3_157_508]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters + floating buffers of a freshly built model (what ``initial_params`` returns)."""
    buffers = dict(model.named_buffers())
    return {
        **{k: v.detach().clone() for k, v in model.named_parameters()},
        **{k: buffers[k].detach().clone() for k in buffer_names(model)},
    }


def resnet(seed: int = 0, classes: int = 10, size: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("resnet18", (3, size, size), classes)


# ---- unit maps and ALA weight counts (FedALA paper, Appendix C Table 5; Tables 1 and 6) ----------
def test_models_are_registered():
    assert {"resnet18", "fasttext"} <= set(MODELS)


def test_resnet18_units_and_ala_weight_counts():
    model = resnet(size=64)
    units = model.units()
    assert [u for u, _ in units] == ["conv1", "layer1", "layer2", "layer3", "layer4", "fc"]
    assert units[0][1] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert units[-1][1] == ["fc.weight", "fc.bias"]
    assert [count_parameters(model, top_unit_names(units, p)) for p in range(1, 7)] == RESNET_COUNTS
    assert reference_layer_idx(units, 1) == 2
    assert count_parameters(model) == RESNET_COUNTS[-1]


def test_fasttext_units_and_ala_weight_counts():
    model = build_model("fasttext", (200,), 4, vocab_size=98_635)
    units = model.units()
    assert units == [
        ("embedding", ["embedding.weight"]),
        ("fc1", ["fc1.weight", "fc1.bias"]),
        ("fc", ["fc.weight", "fc.bias"]),
    ]
    assert [count_parameters(model, top_unit_names(units, p)) for p in range(1, 4)] == FASTTEXT_COUNTS
    assert reference_layer_idx(units, 1) == 2
    assert model.linear_head and model.prefix_is_deterministic
    assert buffer_names(model) == [] and model.buffer_names() == []


def test_resnet18_names_buffers_and_init_follow_torchvision():
    model = resnet()
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == 62
    assert names[:4] == ["conv1.weight", "bn1.weight", "bn1.bias", "layer1.0.conv1.weight"]
    for name in [
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.weight",
        "layer2.0.downsample.1.bias",
        "layer4.1.bn2.bias",
        "fc.weight",
    ]:
        assert name in names
    assert not any(n.startswith(("layer1.0.downsample", "layer2.1.downsample")) for n in names)
    buffers = buffer_names(model)
    assert buffers == model.buffer_names()
    assert len(buffers) == 40 and buffers[:2] == ["bn1.running_mean", "bn1.running_var"]
    assert "layer3.0.downsample.1.running_var" in buffers
    assert all(b.is_floating_point() for _, b in model.named_buffers())  # no num_batches_tracked
    assert not any("num_batches_tracked" in n for n in model.state_dict())
    params = dict(model.named_parameters())
    assert params["conv1.weight"].shape == (64, 3, 7, 7)
    assert params["layer2.0.downsample.0.weight"].shape == (128, 64, 1, 1)
    assert torch.equal(params["layer3.1.bn1.weight"], torch.ones(256))
    assert torch.equal(params["layer3.1.bn1.bias"], torch.zeros(256))
    std = params["layer4.1.conv2.weight"].std().item()  # kaiming normal, fan_out = 512 * 9
    assert std == pytest.approx((2 / (512 * 9)) ** 0.5, rel=0.05)
    assert model.prefix_is_deterministic is False


@pytest.mark.parametrize("size", [32, 64])
def test_resnet18_forward_shape(size):
    model = resnet(size=size, classes=7)
    params = full_params(model)
    x = torch.randn(2, 3, size, size)
    assert forward(model, params, x).shape == (2, 7)
    features = forward(model, params, x, stop=5)
    assert features.shape == (2, 512)
    assert torch.allclose(forward(model, params, features, start=5), forward(model, params, x))


def test_build_model_checks_input_shapes():
    with pytest.raises(ValueError, match="square images"):
        build_model("resnet18", (3, 32, 48), 10)
    with pytest.raises(ValueError, match="at least 32x32"):
        build_model("resnet18", (3, 16, 16), 10)
    with pytest.raises(ValueError, match="vocab_size"):
        build_model("fasttext", (200,), 4)
    with pytest.raises(ValueError, match=r"shape \[L\]"):
        build_model("fasttext", (3, 32, 32), 4, vocab_size=100)
    with pytest.raises(ValueError, match="square images"):
        build_model("fedavg_cnn", (200,), 4, vocab_size=100)


def test_integer_buffers_other_than_the_bn_counter_are_refused():
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.bn = nn.BatchNorm1d(2)  # keeps num_batches_tracked: tolerated, not carried
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    with pytest.raises(NotImplementedError, match="steps"):
        check_buffers(Counter())
    ok = nn.BatchNorm1d(2)
    check_buffers(ok)
    assert buffer_names(ok) == ["running_mean", "running_var"]


# ---- batch norm: training vs evaluation mode --------------------------------------------------
def test_batch_norm_train_mode_uses_batch_stats_and_updates_running_stats_in_place():
    model = resnet()
    params = full_params(model)
    x = torch.randn(4, 3, 32, 32)
    conv = F.conv2d(x, params["conv1.weight"], stride=2, padding=3)
    reference_bn = nn.BatchNorm2d(64)  # torch's own module in training mode, momentum 0.1
    reference_bn.train()
    expected = F.max_pool2d(F.relu(reference_bn(conv)), 3, 2, 1)

    out = forward(model, params, x, stop=1, train=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(params["bn1.running_mean"], reference_bn.running_mean)
    torch.testing.assert_close(params["bn1.running_var"], reference_bn.running_var)

    # training mode ignores the running statistics; evaluation mode uses them
    shifted = {**params, "bn1.running_mean": params["bn1.running_mean"] + 5.0}
    torch.testing.assert_close(forward(model, {k: v.clone() for k, v in shifted.items()}, x, stop=1, train=True), out)
    before = {k: v.clone() for k, v in params.items()}
    eval_out = forward(model, params, x, stop=1)  # train=False is the default
    reference_bn.eval()
    torch.testing.assert_close(eval_out, F.max_pool2d(F.relu(reference_bn(conv)), 3, 2, 1))
    assert not torch.allclose(eval_out, forward(model, shifted, x, stop=1, train=False))
    for k in params:  # evaluation mode changes nothing
        assert torch.equal(params[k], before[k])


def test_module_forward_follows_module_mode():
    model = resnet()
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    a = model(x)
    assert torch.equal(model.bn1.running_mean, torch.zeros(64))
    model.train()
    b = model(x)
    assert not torch.equal(model.bn1.running_mean, torch.zeros(64))
    assert not torch.allclose(a, b)


def test_sgd_updates_running_stats_in_the_returned_dict_and_leaves_the_input_alone():
    model = resnet()
    params = full_params(model)
    before = {k: v.clone() for k, v in params.items()}
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(2)]
    out, loss = fit_on(model, params, batches, lr=0.05)
    assert list(out) == list(params) and loss > 0
    for k in params:
        assert torch.equal(params[k], before[k]), k  # the caller's tensors are untouched
    buffers = set(buffer_names(model))
    for k in buffers:
        assert not torch.equal(out[k], before[k]), k  # running statistics moved
        assert not out[k].requires_grad
    assert not torch.equal(out["conv1.weight"], before["conv1.weight"])
    assert not torch.equal(out["fc.bias"], before["fc.bias"])
    # frozen parameters stay, buffers still follow the training-mode forward passes
    head, _ = fit_on(model, params, batches[:1], lr=0.05, trainable=["fc.weight", "fc.bias"])
    full, _ = fit_on(model, params, batches[:1], lr=0.05)
    assert torch.equal(head["conv1.weight"], before["conv1.weight"])
    assert not torch.equal(head["fc.weight"], before["fc.weight"])
    for k in buffers:  # one step: both forward passes saw the initial body
        torch.testing.assert_close(head[k], full[k])
        assert not torch.equal(head[k], before[k])
    # buffer names passed as trainable are never trained (they get no gradient)
    named, _ = fit_on(model, params, batches[:1], lr=0.05, trainable=["fc.bias", "bn1.running_mean"])
    assert torch.equal(named["fc.weight"], before["fc.weight"])


def test_evaluate_runs_in_evaluation_mode():
    model = resnet()
    params = full_params(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 3, 32, 32, generator=g), torch.randint(0, 10, (5,), generator=g)
    before = {k: v.clone() for k, v in params.items()}
    result = evaluate(model, params, x, y, batch_size=2)
    logits = forward(model, params, x, train=False)
    assert result["correct"] == int((logits.argmax(1) == y).sum())
    assert result["loss_sum"] == pytest.approx(float(F.cross_entropy(logits, y, reduction="sum")), rel=1e-5)
    for k in params:
        assert torch.equal(params[k], before[k])


# ---- fastText ------------------------------------------------------------------------------------
def test_fasttext_mean_includes_padding_and_padding_row_gets_no_gradient():
    torch.manual_seed(0)
    model = build_model("fasttext", (6,), 3, vocab_size=20)
    params = full_params(model)
    assert torch.equal(params["embedding.weight"][0], torch.zeros(32))
    x = torch.tensor([[5, 7, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6]])
    h = forward(model, params, x, stop=1)
    torch.testing.assert_close(h[0], (params["embedding.weight"][5] + params["embedding.weight"][7]) / 6)
    params["embedding.weight"][0] = 1.0  # even a non-zero padding row is never trained
    out, _ = fit_on(model, params, [(x, torch.tensor([0, 2]))], lr=0.5)
    assert torch.equal(out["embedding.weight"][0], params["embedding.weight"][0])
    assert not torch.equal(out["embedding.weight"][5], params["embedding.weight"][5])
    assert torch.equal(out["embedding.weight"][10], params["embedding.weight"][10])  # unused token


# ---- initial parameters -------------------------------------------------------------------------
def test_initial_params_carry_float_buffers_and_vocab_size():
    config = load_config(None, ["model=resnet18"])
    model, init = initial_params(config, ((3, 32, 32), 10), seed=0, device=torch.device("cpu"))
    assert list(init) == [n for n, _ in model.named_parameters()] + buffer_names(model)
    assert torch.equal(init["bn1.running_var"], torch.ones(64))
    _, again = initial_params(config, ((3, 32, 32), 10), seed=0, device=torch.device("cpu"))
    assert all(torch.equal(init[k], again[k]) for k in init)

    config = load_config(None, ["model=fasttext"])
    model, init = initial_params(config, ((12,), 4, 50), seed=0, device=torch.device("cpu"))
    assert init["embedding.weight"].shape == (50, 32)
    data = text_data([5, 6])
    data.vocab_size = 50  # FederatedData.vocab_size (text datasets)
    model, init = initial_params(config, data, seed=0, device=torch.device("cpu"))
    assert init["embedding.weight"].shape == (50, 32)
    with pytest.raises(ValueError, match="vocab_size"):
        initial_params(config, ((12,), 4), seed=0, device=torch.device("cpu"))


# ---- ALA with batch norm --------------------------------------------------------------------------
def image_client(n_train: int = 8, n_test: int = 4, seed: int = 0, client_id: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n_train + n_test,), generator=g)
    return ClientData(client_id, x[:n_train], y[:n_train], x[n_train:], y[n_train:])


@pytest.mark.parametrize("p", [1, 2])
def test_ala_on_resnet18_leaves_the_stored_buffers_alone(p):
    model = resnet(seed=0)
    local = full_params(model)
    glob = full_params(resnet(seed=1))
    glob = {k: v + 0.5 if k.endswith("running_mean") else v for k, v in glob.items()}
    train = TrainSettings(batch_size=4, local_epochs=1, lr=0.05)
    ctx = SingleClientContext(
        client_id=0,
        round=2,
        seed=0,
        data=image_client(),
        model=model,
        units=model.units(),
        train=train,
        algorithm="test",
    )
    ala = AdaptiveLocalAggregation(ALASettings(p=p, max_start_epochs=2), ctx.units, train)
    received = {k: glob[k] for k, _ in model.named_parameters()}  # bn_buffers = local: no buffers sent
    state = ala.init_state(received)
    assert set(state["weights"]) == set(top_unit_names(ctx.units, p))
    local_before = {k: v.clone() for k, v in local.items()}
    out, new_state, info = ala(received, local, state, ctx)
    assert info["ala_epochs"] == 2 and new_state["started"]
    assert list(out) == list(local)
    for k in local:
        assert torch.equal(local[k], local_before[k]), k  # the stored local model is untouched
    for k in buffer_names(model):
        assert torch.equal(out[k], local_before[k]), k  # buffers are no ALA weights
    assert torch.equal(out["conv1.weight"], glob["conv1.weight"])  # lower units overwritten
    # a download that carries buffers overwrites them (bn_buffers = global), still without mutation
    glob_before = {k: v.clone() for k, v in glob.items()}
    out, _, _ = ala(glob, local, state, ctx)
    for k in buffer_names(model):
        assert torch.equal(out[k], glob_before[k]) and torch.equal(glob[k], glob_before[k]), k
        assert torch.equal(local[k], local_before[k]), k


# ---- tiny end-to-end runs ------------------------------------------------------------------------
def image_data(sizes: list[int]) -> FederatedData:
    return FederatedData.from_clients(
        [image_client(n, 4, seed=i, client_id=i) for i, n in enumerate(sizes)], 10, "toy-images"
    )


def text_data(
    sizes: list[int], vocab: int = 50, length: int = 12, classes: int = 4, test: int = 4, seed: int = 0
) -> FederatedData:
    """Random token ids (0 = padding at the end) whose labels depend on the tokens used."""
    g = torch.Generator().manual_seed(seed)
    clients = []
    for i, n in enumerate(sizes):
        y = torch.randint(0, classes, (n + test,), generator=g)
        x = torch.randint(1, vocab, (n + test, length), generator=g)
        x[:, :3] = 1 + y[:, None] * 3 + torch.randint(0, 3, (n + test, 3), generator=g)  # label tokens
        lengths = torch.randint(4, length + 1, (n + test,), generator=g)
        x[torch.arange(length)[None, :] >= lengths[:, None]] = 0
        clients.append(ClientData(i, x[:n], y[:n], x[n:], y[n:]))
    return FederatedData.from_clients(clients, classes, "toy-text")


def run(
    name: str,
    engine,
    data: FederatedData,
    model_name: str,
    rounds: int,
    batch_size: int,
    lr: float,
    vocab_size: int | None = None,
    overrides: tuple[str, ...] = (),
):
    cfg = load_config(None, ["fedala.max_start_epochs=2", *overrides])
    torch.manual_seed(0)
    model = build_model(model_name, data.input_shape, data.num_classes, vocab_size=vocab_size)
    train = TrainSettings(batch_size=batch_size, local_epochs=1, lr=lr)
    alg = build_algorithm(name, cfg.algorithm_sections(), train, model.units())
    setup = RoundSetup(alg, data, model, model.units(), train, seed=3)
    return simulate_rounds(setup, engine, full_params(model), rounds)


def compare(a, b, atol: float) -> None:
    assert_states_close(a, b, atol)
    for ra, rb in zip(a.history, b.history, strict=True):
        if "accuracy" in ra:
            assert ra["accuracy"] == pytest.approx(rb["accuracy"], abs=1 / 8 + 1e-9)
        if "ala_epochs" in ra:
            assert ra["ala_epochs"] == rb["ala_epochs"]


@pytest.mark.parametrize("name", ["fedavg", "fedala"])
def test_resnet18_end_to_end_loop_vmap_fallback_and_parallel(name, caplog):
    data = image_data([8, 8])
    reference = run(name, LoopEngine(), data, "resnet18", rounds=2, batch_size=4, lr=0.05)
    assert all(torch.isfinite(torch.tensor(r["test_loss"])) for r in reference.history if "test_loss" in r)
    if name == "fedala":
        assert reference.history[-1]["ala_epochs"] > 0
    server = reference.server["global"]
    assert set(buffer_names(build_model("resnet18", (3, 32, 32), 10))) <= set(server)
    assert not torch.equal(server["bn1.running_var"], torch.ones(64))  # averaged client statistics
    with caplog.at_level(logging.INFO, logger="pflkit.engines"):
        batched = run(name, VmapEngine(), data, "resnet18", rounds=2, batch_size=4, lr=0.05)
    if name == "fedala":  # ALA's samples would pad batch-norm batches: client by client
        assert "one by one" in caplog.text
        compare(reference, batched, atol=0.0)  # the fallback runs exactly the loop engine's code
    else:  # batched, each client's statistics updated from its own batches (checked against the
        # client alone in tests/methods/test_fedbn.py): here batch norm over 4 samples is chaotic (a
        # 1e-7 change of the initial model moves the loop engine's round by 0.05, measured)
        assert "one by one" not in caplog.text
        assert all(torch.isfinite(torch.tensor(r["test_loss"])) for r in batched.history if "test_loss" in r)
        assert set(batched.server["global"]) == set(server)
    if name == "fedala":
        engine = ParallelEngine(2)
        try:
            compare(reference, run(name, engine, data, "resnet18", rounds=2, batch_size=4, lr=0.05), atol=0.0)
        finally:
            engine.close()


@pytest.mark.parametrize("name,p", [("fedavg", 1), ("fedala", 1), ("fedala", 3), ("fedrep", 1)])
def test_fasttext_loop_and_vmap_engines_agree(name, p):
    data = text_data([20, 13, 7])
    kw = {
        "model_name": "fasttext",
        "rounds": 2,
        "batch_size": 5,
        "lr": 0.5,
        "vocab_size": 50,
        "overrides": ("fedrep.head_epochs=1", f"fedala.p={p}"),
    }
    reference = run(name, LoopEngine(), data, **kw)
    batched = run(name, VmapEngine(chunk_size=2), data, **kw)  # vmapped, with batched embedding weights
    compare(reference, batched, atol=1e-3 if "ala" in name else 1e-5)
    for state in (reference, batched):  # the padding row never moves
        assert torch.equal(state.server["global"]["embedding.weight"][0], torch.zeros(32))


class FedNHResNet18(torch.nn.Module):
    """My transcription of FedNH's ResNet-18 (Yutong-Dai/FedNH 60c3161, src/flbase/models/ResNet.py
    ResNet18 with BasicBlock): conv3x3(64, stride 1) -> GN(2) -> ReLU, no max pool; stages of two
    blocks (conv3x3 -> GN -> ReLU -> conv3x3 -> GN, + shortcut conv1x1 -> GN when the shape
    changes, -> ReLU); adaptive average pooling; linear head (here with a bias, as pflkit's)."""

    class Block(torch.nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = torch.nn.GroupNorm(2, cout)
            self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = torch.nn.GroupNorm(2, cout)
            self.downsample = (
                torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.GroupNorm(2, cout))
                if stride != 1 or cin != cout
                else torch.nn.Identity()
            )

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + self.downsample(x))

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = torch.nn.GroupNorm(2, 64)
        cin = 64
        for i, (cout, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2)), start=1):
            setattr(self, f"layer{i}", torch.nn.Sequential(self.Block(cin, cout, stride), self.Block(cout, cout, 1)))
            cin = cout
        self.fc = torch.nn.Linear(512, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


def test_resnet18_gn_is_fednhs_resnet18_with_group_norm_and_a_cifar_stem():
    from pflkit.functional import forward

    model = build_model("resnet18_gn", (3, 32, 32), 7)
    assert not list(model.buffers())  # GroupNorm keeps no running statistics
    reference = FedNHResNet18(7)
    missing = reference.load_state_dict(dict(model.named_parameters()), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    params = dict(model.named_parameters())
    torch.testing.assert_close(forward(model, params, x, train=False), reference(x), rtol=1e-4, atol=1e-5)
    assert [name for name, _ in model.units()] == ["conv1", "layer1", "layer2", "layer3", "layer4", "fc"]
    # the stem keeps the resolution: layer3 gives 16x16 maps at 64x64, layer4 8x8 before the pooling
    # (torchvision's stem: 4x4 and 2x2)
    x64 = torch.randn(1, 3, 64, 64)
    assert forward(model, params, x64, train=False, stop=4).shape == (1, 256, 16, 16)
    assert forward(model, params, x64, train=False, stop=5).shape == (1, 512)
    assert count_parameters(model) == sum(p.numel() for p in reference.parameters())


class SuPerFedTwoCNN(nn.Module):
    """SuPerFed's TwoCNN (vaseline555/SuPerFed 06860db, src/models/models.py), as read: the
    "simple CNN (hahn2022connecting)" SosicFL cites, with torch.nn modules."""

    def __init__(self, in_channels: int, classes: int, flat: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=1, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(2, padding=1),
            nn.Conv2d(32, 64, 5, padding=1, bias=False),
            nn.ReLU(),
            nn.MaxPool2d(2, padding=1),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(flat, 200, bias=False),
            nn.ReLU(),
            nn.Linear(200, 200, bias=False),
            nn.ReLU(),
            nn.Linear(200, classes, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.layers(x))


class FedNHConv2Cifar(nn.Module):
    """FedNH's Conv2Cifar (Yutong-Dai/FedNH 60c3161, src/flbase/models/CNN.py), as read."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 64, 5), nn.Conv2d(64, 64, 5)
        self.fc1, self.fc2 = nn.Linear(64 * 5 * 5, 384), nn.Linear(384, 192)
        self.prototype = nn.Linear(192, classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.prototype(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


@pytest.mark.parametrize("size,flat", [(28, 3136), (32, 4096)])
def test_simple_cnn_is_superfeds_two_cnn(size, flat):
    model = build_model("simple_cnn", (3, size, size), 10)
    reference = SuPerFedTwoCNN(3, 10, flat)
    ours = dict(model.named_parameters())
    theirs = dict(zip([n for n, _ in reference.named_parameters()], ours.values()))
    reference.load_state_dict(theirs, strict=True)  # same shapes in the same order, no biases anywhere
    assert not any(n.endswith("bias") for n in ours)
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(forward(model, ours, x, train=False), reference(x), rtol=1e-5, atol=1e-6)
    assert [n for n, _ in model.units()] == ["conv1", "conv2", "fc1", "fc2", "classifier"]


def test_conv2cifar_is_fednhs_model_and_cifar_cnn_keeps_a_classifier_bias():
    model = build_model("conv2cifar", (3, 32, 32), 7)
    reference = FedNHConv2Cifar(7)
    ours = dict(model.named_parameters())
    reference.load_state_dict(dict(zip([n for n, _ in reference.named_parameters()], ours.values())), strict=True)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(forward(model, ours, x, train=False), reference(x), rtol=1e-5, atol=1e-6)
    assert "fc.bias" not in ours and "fc.bias" in dict(build_model("cifar_cnn", (3, 32, 32), 7).named_parameters())


def _image_data(sizes: list[int], side: int, seed: int = 0) -> FederatedData:
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(10, 1, side, side, generator=g)
    clients = []
    for i, n in enumerate(sizes):
        y = torch.randint(0, 10, (n + 4,), generator=g)
        x = means[y] + 0.5 * torch.randn(n + 4, 1, side, side, generator=g)
        clients.append(ClientData(i, x[:n], y[:n], x[n:], y[n:]))
    return FederatedData.from_clients(clients, 10, "toy")


# every base method, and ALA on two of them
BIAS_FREE_HEAD_METHODS = [a for a in available() if "+ala" not in a] + ["fedavg+ala", "fednh+ala"]


@pytest.mark.parametrize("model_name", ["conv2cifar", "simple_cnn"])
@pytest.mark.parametrize("name", BIAS_FREE_HEAD_METHODS)
def test_every_algorithm_trains_a_model_whose_classifier_has_no_bias(name, model_name):
    """The bias-free heads of FedNH's Conv2Cifar and SuPerFed's TwoCNN: every method runs a round on
    them with finite losses and scored accuracies (CReFF and FedNH then keep no classifier bias, as
    FedNH's ports do)."""
    data = _image_data([24, 30, 18], side=16)
    cfg = load_config(
        None,
        [
            "fedala.max_start_epochs=2",
            "fedrep.head_epochs=1",
            "ditto.personal_epochs=1",
            "creff.match_steps=2",
            "creff.retrain_epochs=2",
            'fedproto.scoring="head"',  # nearest-prototype scoring needs a head bias (refused in one line)
        ],
    )
    torch.manual_seed(0)
    model = build_model(model_name, (1, 16, 16), 10)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    train = TrainSettings(batch_size=8, local_epochs=1, lr=0.05)
    alg = build_algorithm(name, cfg.algorithm_sections(), train, model.units())
    result = simulate_rounds(RoundSetup(alg, data, model, model.units(), train, seed=3), LoopEngine(), init, 1)
    losses = [r["train_loss"] for r in result.history if "train_loss" in r]
    assert losses and all(np.isfinite(losses))
    accuracies = [r["accuracy"] for r in result.history if "accuracy" in r]
    assert accuracies and all(0 <= a <= 1 for a in accuracies)


def test_fast_pooling_gives_max_pool2d_numbers():
    """max_pool_2x2 equals F.max_pool2d (ties, NaN, odd sizes), without autograd and with it."""
    import torch.nn.functional as F

    from pflkit.models.pooling import max_pool_2x2

    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (4, 3, 8, 8), generator=g).float()  # many ties
    x[0, 0, 0, 0] = float("nan")
    with torch.no_grad():
        assert torch.equal(max_pool_2x2(x).nan_to_num(9.0), F.max_pool2d(x, 2).nan_to_num(9.0))
        odd = torch.randn(2, 3, 7, 7, generator=g)
        assert torch.equal(max_pool_2x2(odd), F.max_pool2d(odd, 2))
    # with autograd (channels-last on a plain tensor, the default layout under vmap): the same values and
    # gradients, bit for bit, ties and NaN included (the gradient goes to each window's first maximum)
    upstream = torch.randn(4, 3, 4, 4, generator=g)
    ours, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, expected = max_pool_2x2(ours), F.max_pool2d(theirs, 2)
    assert out.grad_fn is not None
    assert torch.equal(out.nan_to_num(9.0), expected.nan_to_num(9.0))
    out.backward(upstream)
    expected.backward(upstream)
    assert torch.equal(ours.grad, theirs.grad)
    # as the batched engine differentiates: grad under vmap
    clients, weights = torch.stack([x, -x]), torch.stack([upstream, upstream.flip(0)])
    grads = torch.func.vmap(torch.func.grad(lambda t, u: (max_pool_2x2(t) * u).sum()))(clients, weights)
    expected_grads = torch.func.vmap(torch.func.grad(lambda t, u: (F.max_pool2d(t, 2) * u).sum()))(clients, weights)
    assert torch.equal(grads, expected_grads)


def test_fedavg_cnn_pools_before_its_relu_with_the_same_values_and_gradients():
    """ReLU after the pool (a quarter of the elements) gives ReLU-then-pool's numbers bit for bit."""
    import torch.nn.functional as F

    from pflkit.models import build_model

    torch.manual_seed(0)
    model = build_model("fedavg_cnn", (1, 28, 28), 10)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    x = torch.zeros(6, 1, 28, 28)
    x[:, :, 8:20, 8:20] = torch.rand(6, 1, 12, 12)  # a blank border: exact ties in the pooled maps

    def reference(p):
        h = F.max_pool2d(F.relu(F.conv2d(x, p["conv1.weight"], p["conv1.bias"])), 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, p["conv2.weight"], p["conv2.bias"])), 2)
        h = F.relu(F.linear(torch.flatten(h, 1), p["fc1.weight"], p["fc1.bias"]))
        return F.linear(h, p["fc.weight"], p["fc.bias"])

    ours = model.apply_units(params, x, 0, None, train=True)
    theirs = reference(params)
    assert torch.equal(ours, theirs)
    g1 = torch.autograd.grad(ours.square().sum(), list(params.values()))
    g2 = torch.autograd.grad(theirs.square().sum(), list(params.values()))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    with torch.no_grad():
        assert torch.equal(model.apply_units(params, x, 0, None, train=True), reference(params))


def test_a_model_routes_through_one_module_between_body_and_head():
    """Entries of two kinds of module between body and head are refused in one line naming both,
    where routing through the first found would silently ignore the other."""
    from pflkit.algorithms.feddbe import BIAS
    from pflkit.algorithms.fednh import COSINE
    from pflkit.models.between import between_of

    assert (BIAS.kind, COSINE.kind) == ("dbe", "cosine")
    plain = {"fc.weight": torch.zeros(2, 2)}
    dbe = {**plain, "between.dbe.bias": torch.zeros(2)}
    assert between_of(plain) is None and between_of(dbe) is BIAS
    with pytest.raises(ValueError, match="two modules between body and head, 'dbe' and 'cosine'"):
        between_of({**dbe, "between.cosine.scale": torch.ones(())})
    with pytest.raises(KeyError, match="belongs to no registered module"):
        between_of({**plain, "between.nothing.x": torch.zeros(1)})

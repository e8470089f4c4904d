"""fedavg_cnn_bn: FedALA/PFLlib's 4-layer CNN with batch norm after every layer but the classifier
(FedBN's recipe), against the same network written with torch.nn's own layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pflkit.functional import forward
from pflkit.models import build_model, count_parameters, norm_layers


def torch_layers(model: nn.Module) -> nn.Sequential:
    """The network written with torch.nn's layers, holding copies of ``model``'s weights and statistics."""
    net = nn.Sequential(
        nn.Conv2d(1, 32, 5), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
        nn.Linear(512, 10),
    )  # fmt: skip
    mine = dict(model.state_dict())
    names = {0: "conv1", 1: "bn1", 4: "conv2", 5: "bn2", 9: "fc1", 10: "bn3", 12: "fc"}
    theirs = {
        f"{i}.{k}": mine[f"{name}.{k}"]
        for i, name in names.items()
        for k in net[i].state_dict()
        if k != "num_batches_tracked"  # torch's counter; pflkit's batch norm has a fixed momentum
    }
    missing, unexpected = net.load_state_dict(theirs, strict=False)
    assert not unexpected and all(k.endswith("num_batches_tracked") for k in missing)
    return net


@pytest.mark.parametrize("train", [True, False])
def test_the_forward_pass_gradients_and_statistics_are_torch_nns(train: bool) -> None:
    torch.manual_seed(0)
    model = build_model("fedavg_cnn_bn", (1, 28, 28), 10)
    for name, buffer in model.named_buffers():  # statistics away from their init, so eval mode uses them
        if name.endswith("running_mean"):
            buffer.normal_()
        elif name.endswith("running_var"):
            buffer.uniform_(0.5, 2.0)
    net = torch_layers(model)
    net.train(train)
    params = {k: v.detach().clone().requires_grad_(v.dtype.is_floating_point and "running" not in k)
              for k, v in model.state_dict().items() if "num_batches" not in k}  # fmt: skip
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    ours = forward(model, params, x, train=train)
    expected = net(x)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    nn.functional.cross_entropy(ours, y).backward()
    nn.functional.cross_entropy(expected, y).backward()
    torch.testing.assert_close(params["fc1.weight"].grad, net[9].weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(params["bn1.weight"].grad, net[1].weight.grad, rtol=1e-4, atol=1e-6)
    # train mode moves the running statistics (momentum 0.1) as torch's layers do; eval mode leaves them
    torch.testing.assert_close(params["bn3.running_mean"], net[10].running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(params["bn1.running_var"], net[1].running_var, rtol=1e-5, atol=1e-6)


def test_it_is_fedavg_cnn_plus_three_batch_norm_layers() -> None:
    plain, with_bn = build_model("fedavg_cnn", (1, 28, 28), 10), build_model("fedavg_cnn_bn", (1, 28, 28), 10)
    assert count_parameters(with_bn) == count_parameters(plain) + 2 * (32 + 64 + 512)
    assert norm_layers(with_bn.state_dict()) == {"bn1", "bn2", "bn3"}
    assert [n for n, _ in plain.named_parameters()] == [
        n for n, _ in with_bn.named_parameters() if not n.startswith("bn")
    ]
    with pytest.raises(ValueError, match="at least 16x16"):
        build_model("fedavg_cnn_bn", (1, 8, 8), 10)

"""SosicFL's torchvision models: their sizes, declared heads and pretrained weights."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize(
    "name,shape,params,units",
    [
        ("simple_cnn", (3, 32, 32), 914_800, 5),
        ("mobilenet_v2", (3, 64, 64), 2_480_072, 20),
        ("squeezenet1_1", (3, 32, 32), 825_096, 10),
    ],
)
def test_sosicfl_models_have_torchvision_sizes_and_a_declared_head(name, shape, params, units) -> None:
    from pflkit.models import build_model, head_names

    model = build_model(name, shape, 200 if name != "simple_cnn" else 10)
    # torchvision's counts for 200 classes; SimpleCNN (no biases): 2,400 + 51,200 + 4,096 x 200 + 200 x 200 + 200 x 10
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(model.units()) == units
    assert head_names(model.units())[0].endswith("weight") and model(torch.randn(2, *shape)).shape[1] in (10, 200)


def test_pretrained_weights_load_by_torchvision_keys_and_bad_files_are_named(tmp_path) -> None:
    from pflkit.models import build_model, head_names, load_pretrained

    source = build_model("squeezenet1_1", (3, 32, 32), 1000)  # "ImageNet": 1000 classes
    torch.save(source.state_dict(), tmp_path / "imagenet.pt")
    target = build_model("squeezenet1_1", (3, 32, 32), 10)
    head = head_names(target.units())
    loaded = load_pretrained(target, str(tmp_path / "imagenet.pt"), head)
    assert torch.equal(loaded["features.3.squeeze.weight"], source.state_dict()["features.3.squeeze.weight"])
    assert loaded["classifier.1.weight"].shape == (10, 512, 1, 1)  # the head of another size stays fresh
    with pytest.raises(ValueError, match="no such file"):
        load_pretrained(target, str(tmp_path / "nope.pt"), head)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable PyTorch state dict"):
        load_pretrained(target, str(tmp_path / "junk.pt"), head)
    with pytest.raises(ValueError, match="missing .* keys"):
        load_pretrained(build_model("mobilenet_v2", (3, 64, 64), 10), str(tmp_path / "imagenet.pt"), head)
    state = source.state_dict()
    state["features.3.squeeze.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"features.3.squeeze.weight has shape \(1,\)"):
        load_pretrained(target, str(tmp_path / "bad.pt"), head)

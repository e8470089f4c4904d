"""benchmarks/dead_units.py: the clients whose network has collapsed, named from a checkpoint."""

from __future__ import annotations

import pytest

from pflkit.config import load_config
from pflkit.federation.checkpoint import load_checkpoint, save_checkpoint
from pflkit.run.experiment import run_experiment
from tests.support.paths import load_script

pytestmark = pytest.mark.integration


def test_a_client_with_a_dead_layer_is_named_and_the_others_are_not(tmp_path) -> None:
    config = load_config(None, ["num_clients=3", "rounds=1", 'algorithms=["fedgh"]', "seeds=[0]"])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    path = tmp_path / "run" / "checkpoints" / "fedgh-seed0.pt"
    state = load_checkpoint(path)
    first = sorted(state.clients)[0]
    model = state.clients[first]["model"]
    model["conv2.bias"] = model["conv2.bias"] - 1e4  # every pre-activation of conv2 negative: the layer is dead
    save_checkpoint(path, state)

    result = load_script("benchmarks/dead_units.py").dead_units(tmp_path / "run", "fedgh", 0)

    assert result["rounds_done"] == 1
    assert result["collapsed_clients"] == [str(first)]
    dead = result["clients"][str(first)]["model"]
    assert dead["dead_units"] == ["conv2"] and dead["constant_features"]
    assert [u["live"] for u in dead["units"]][1] == 0.0
    for cid, sets in result["clients"].items():
        if cid != str(first):
            assert sets["model"]["dead_units"] == [] and not sets["model"]["constant_features"]
            assert all(u["live"] > 0 and u["spread"] > 0 for u in sets["model"]["units"][:-1])

"""benchmarks/score_states.py: every model a checkpoint holds, scored as the run scores its own."""

from __future__ import annotations

import json

import pytest

from pflkit.config import load_config
from pflkit.run.experiment import run_experiment
from tests.support.paths import load_script

pytestmark = pytest.mark.integration


def _script():  # type: ignore[no-untyped-def]
    return load_script("benchmarks/score_states.py")


def test_the_scored_model_of_a_finished_run_matches_its_last_record(tmp_path) -> None:
    config = load_config(None, ["num_clients=4", "rounds=2", 'algorithms=["pfedme", "ditto"]', "seeds=[0]"])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    score = _script().score_states
    for algorithm, scored in (("pfedme", "client personal"), ("ditto", "client personal")):
        last = [r for r in records if r["algorithm"] == algorithm][-1]
        result = score(tmp_path / "run", algorithm, 0)
        assert result["rounds_done"] == 2
        assert result["test_samples"] > 0
        assert {"client model", "client personal", "server global"} <= set(result["accuracy"])
        assert result["accuracy"][scored] == pytest.approx(last["accuracy"], abs=1e-12)


def test_a_run_without_its_checkpoint_is_named(tmp_path) -> None:
    config = load_config(None, ["num_clients=4", "rounds=1", 'algorithms=["fedavg"]', "seeds=[0]"])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    with pytest.raises(FileNotFoundError, match="pfedme-seed0.pt"):
        _script().score_states(tmp_path / "run", "pfedme", 0)


@pytest.mark.parametrize("algorithm", ["fedbn", "fedper", "fedrep"])
def test_a_personal_part_method_scores_its_client_model_with_the_downloaded_layers_as_recorded(
    tmp_path, algorithm
) -> None:
    config = load_config(
        None, ["num_clients=4", "rounds=2", f'algorithms=["{algorithm}"]', "seeds=[0]", 'model="fedbn_cnn"']
    )
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    result = _script().score_states(tmp_path / "run", algorithm, 0, recalibrate_bn=algorithm == "fedbn")
    accuracy = result["accuracy"]
    assert accuracy["client model + server shared"] == pytest.approx(last["accuracy"], abs=1e-12)
    assert accuracy["client model"] != accuracy["client model + server shared"]
    per_client = last["client_accuracy"].values()
    assert result["client_accuracy_range"]["client model + server shared"] == pytest.approx(
        [min(per_client), max(per_client)], abs=1e-12
    )
    if algorithm == "fedbn":
        recalibrated = "client model + server shared" + _script().RECALIBRATED
        assert recalibrated in accuracy and "server global" + _script().RECALIBRATED in accuracy


def test_recalibrated_statistics_are_each_layers_input_statistics_over_the_split() -> None:
    import torch
    import torch.nn.functional as F

    from pflkit.federation.preparation import initial_model

    model, params = initial_model("fedavg_cnn_bn", ((1, 28, 28), 10), 0, "cpu")
    params = {k: v + 0.3 * torch.rand_like(v) for k, v in params.items()}  # stale statistics too
    before = {k: v.clone() for k, v in params.items()}
    x = torch.randn(40, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    out = _script().recalibrated(model, params, x)

    def norm(h, layer, dims):  # the training-mode batch norm, written out
        mean, var = h.mean(dims), h.var(dims, unbiased=True)
        shape = (1, -1) + (1,) * (h.dim() - 2)
        biased = h.var(dims, unbiased=False)
        z = (h - mean.view(shape)) / torch.sqrt(biased.view(shape) + 1e-5)
        return z * params[f"{layer}.weight"].view(shape) + params[f"{layer}.bias"].view(shape), mean, var

    h1 = F.conv2d(x, params["conv1.weight"], params["conv1.bias"])
    z1, mean1, var1 = norm(h1, "bn1", (0, 2, 3))
    h2 = F.conv2d(F.max_pool2d(F.relu(z1), 2), params["conv2.weight"], params["conv2.bias"])
    z2, mean2, var2 = norm(h2, "bn2", (0, 2, 3))
    h3 = F.linear(F.max_pool2d(F.relu(z2), 2).flatten(1), params["fc1.weight"], params["fc1.bias"])
    _, mean3, var3 = norm(h3, "bn3", (0,))
    for layer, mean, var in (("bn1", mean1, var1), ("bn2", mean2, var2), ("bn3", mean3, var3)):
        torch.testing.assert_close(out[f"{layer}.running_mean"], mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out[f"{layer}.running_var"], var, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(params[k], before[k]) for k in params)
    assert all(torch.equal(out[k], params[k]) for k in params if "running" not in k)


def test_recalibrating_a_model_without_batch_norm_is_refused(tmp_path) -> None:
    config = load_config(None, ["num_clients=4", "rounds=1", 'algorithms=["fedavg"]', "seeds=[0]"])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    with pytest.raises(ValueError, match="no batch-norm layers"):
        _script().score_states(tmp_path / "run", "fedavg", 0, recalibrate_bn=True)


def test_a_per_client_part_on_the_server_is_scored_as_the_run_scores_it(tmp_path) -> None:
    # FedPAC's server keeps each client's combined head: the global model with it is the scored model
    config = load_config(None, ["num_clients=4", "rounds=2", 'algorithms=["fedpac"]', "seeds=[0]"])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    result = _script().score_states(tmp_path / "run", "fedpac", 0)
    scored = "server global + server fedpac.heads"
    assert result["accuracy"][scored] == pytest.approx(last["accuracy"], abs=1e-12)
    per_client = last["client_accuracy"].values()
    assert result["client_accuracy_range"][scored] == pytest.approx([min(per_client), max(per_client)], abs=1e-12)
    assert "server global + client model head" in result["accuracy"]

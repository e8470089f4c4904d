"""benchmarks/newcomer_finetune.py: a run's newcomers rebuilt from its checkpoint, exactly."""

from __future__ import annotations

import pytest

from pflkit.config import load_config
from pflkit.federation import ResultsFolder
from pflkit.federation.checkpoint import load_checkpoint, save_checkpoint
from pflkit.run.experiment import run_experiment
from tests.support.paths import load_script

pytestmark = pytest.mark.integration

OVERRIDES = ["num_clients=5", "unseen_clients=2", "unseen_finetune_epochs=1", "rounds=2", "seeds=[0]"]


@pytest.mark.parametrize("algorithm", ["pfedme", "fedavg"])
def test_the_rebuilt_newcomers_score_what_the_run_recorded(tmp_path, algorithm) -> None:
    config = load_config(None, [*OVERRIDES, f'algorithms=["{algorithm}"]'])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    script = load_script("benchmarks/newcomer_finetune.py")

    result = script.newcomer_finetune(tmp_path / "run", algorithm, 0)

    last = [r for r in ResultsFolder(tmp_path / "run").records() if "unseen_client_accuracy" in r][-1]
    assert result["round"] == last["round"] == 2
    assert {c: v["accuracy"] for c, v in result["clients"].items()} == last["unseen_client_accuracy"]
    assert sorted(result["clients"]) == ["3", "4"]
    for client in result["clients"].values():
        assert 0 < client["most_predicted_share"] <= 1 and client["dead_units"] == []
    # another learning rate is another fine-tuning (not checked against the records)
    slower = script.newcomer_finetune(tmp_path / "run", algorithm, 0, lr=1e-6)
    assert [v["accuracy"] for v in slower["clients"].values()] == pytest.approx(
        [v["received_accuracy"] for v in slower["clients"].values()], abs=0.05
    )


def test_a_rebuild_that_differs_from_the_record_is_an_error(tmp_path) -> None:
    config = load_config(None, [*OVERRIDES, 'algorithms=["fedavg"]'])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    path = tmp_path / "run" / "checkpoints" / "fedavg-seed0.pt"
    state = load_checkpoint(path)
    state.history[-1]["unseen_client_accuracy"]["3"] += 0.01
    save_checkpoint(path, state)
    with pytest.raises(AssertionError, match="client 3: rebuilt newcomer scores"):
        load_script("benchmarks/newcomer_finetune.py").newcomer_finetune(tmp_path / "run", "fedavg", 0)


def test_a_run_without_unseen_clients_is_refused(tmp_path) -> None:
    config = load_config(None, ["num_clients=3", "rounds=1", 'algorithms=["fedavg"]', "seeds=[0]"])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    with pytest.raises(ValueError, match="has no unseen clients"):
        load_script("benchmarks/newcomer_finetune.py").newcomer_finetune(tmp_path / "run", "fedavg", 0)


@pytest.mark.parametrize("lr", [0.0, -0.1, float("nan")])
def test_a_learning_rate_that_is_not_positive_is_refused(tmp_path, lr) -> None:
    with pytest.raises(ValueError, match="--lr must be positive"):
        load_script("benchmarks/newcomer_finetune.py").newcomer_finetune(tmp_path / "absent", "fedavg", 0, lr=lr)


def test_the_configured_finetuning_lr_reaches_the_run_and_the_rebuild(tmp_path) -> None:
    runs = {}
    for name, extra in (("default", []), ("slow", ["unseen_finetune_lr=0.001"])):
        config = load_config(None, [*OVERRIDES, 'algorithms=["fedavg"]', *extra])
        run_experiment(config, tmp_path / name, progress=False, echo=lambda s: None)
        runs[name] = [r["unseen_loss"] for r in ResultsFolder(tmp_path / name).records() if "unseen_loss" in r]
    assert runs["slow"][1:] != pytest.approx(runs["default"][1:], rel=1e-3)
    result = load_script("benchmarks/newcomer_finetune.py").newcomer_finetune(tmp_path / "slow", "fedavg", 0)
    assert result["lr"] == 0.001  # and its scores were checked against the slow run's records

"""Callbacks that end a run's training early (StopRule): the plateau rule on Flower as in the
simulator, a rule of one's own, and the reductions a method declares for its client metrics."""

from __future__ import annotations

import json

import pytest

from pflkit.config import load_config
from pflkit.run.experiment import run_experiment

FAST = ["dataset=synthetic", "num_clients=3", "alpha=0.5", "lr=0.05", "engine=loop"]


def records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_a_stop_rule_of_ones_own_ends_training_and_names_itself(tmp_path):
    class AfterTwoRounds:
        def on_record(self, state, record) -> None:
            pass

        def stop_reason(self, state):
            return "budget" if state.rounds_done >= 2 else None

    config = load_config(None, FAST + ["rounds=10", 'algorithms=["fedavg"]'])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None, callbacks=[AfterTwoRounds()])
    out = records(tmp_path / "run")
    assert [r["round"] for r in out] == [0, 1, 2]
    assert out[-1]["stopped"] == "budget" and "stopped" not in out[-2]


@pytest.mark.integration
@pytest.mark.flower
def test_the_plateau_rule_stops_a_flower_run_where_it_stops_the_simulator(tmp_path):
    pytest.importorskip("flwr")
    from pflkit.flower.client_app import app as client_app
    from pflkit.flower.local import LocalGrid
    from pflkit.flower.server import run_on_flower

    config = load_config(
        None,
        FAST
        + [
            "rounds=30",
            'algorithms=["fedavg", "fedala"]',
            "fedala.max_start_epochs=3",
            "plateau_evaluations=2",
            "plateau_points=100",
        ],
    )
    grid = LocalGrid(client_app, [{"partition-id": i, "num-partitions": 3} for i in range(3)])
    run_on_flower(config, grid, tmp_path / "flower", wait_seconds=5)
    run_experiment(config, tmp_path / "sim", progress=False, echo=lambda s: None)
    flower, sim = records(tmp_path / "flower"), records(tmp_path / "sim")
    key = lambda r: (r["algorithm"], r["round"], r.get("stopped"))  # noqa: E731
    assert [key(r) for r in flower] == [key(r) for r in sim]
    assert [r["round"] for r in sim if r["algorithm"] == "fedavg"] == [0, 1, 2, 3]
    for f, s in zip(flower, sim):
        assert f["accuracy"] == pytest.approx(s["accuracy"], abs=1e-12)
        assert f["test_loss"] == pytest.approx(s["test_loss"], rel=1e-9)


@pytest.mark.integration
def test_a_method_chooses_how_its_client_metrics_reduce_over_a_round(tmp_path, monkeypatch):
    from pflkit.algorithms import Algorithm
    from pflkit.algorithms.fedavg import FedAvg

    def local_train(self, payload, state, ctx):
        state, upload, metrics = Algorithm.local_train(self, payload, state, ctx)
        return (
            state,
            upload,
            {**metrics, "client_id_max": ctx.client_index.float(), "client_id_mean": ctx.client_index.float()},
        )

    monkeypatch.setattr(FedAvg, "local_train", local_train)
    monkeypatch.setattr(FedAvg, "metric_reductions", {"client_id_max": "max"}, raising=False)
    config = load_config(None, FAST + ["rounds=1", 'algorithms=["fedavg"]'])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    trained = [r for r in records(tmp_path / "run") if "train_round" in r][0]
    assert trained["client_id_max"] == 2.0 and trained["client_id_mean"] == 1.0
    assert trained["train_seconds"] > 0  # the engines' wall times: summed over the clients

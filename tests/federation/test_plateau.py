"""The convergence rule (plateau): a run stops once its best accuracy has not improved by more
than plateau_points over the last plateau_evaluations evaluations (rounds is then the cap)."""

from __future__ import annotations

import json

import pytest

from pflkit.config import load_config
from pflkit.federation.driver import Plateau
from pflkit.run.experiment import resume_experiment, run_experiment


def history(*accuracies: float) -> list[dict]:
    return [{"round": r, "accuracy": a} for r, a in enumerate(accuracies)]


def test_the_rule_compares_the_best_of_the_last_evaluations_with_the_best_before():
    rule = Plateau(evaluations=3, points=0.1)
    assert not rule.reached(history(0.5, 0.6, 0.7))  # not more evaluations than the window yet
    assert not rule.reached(history(0.5, 0.6, 0.7, 0.8))  # +10 points within the last three
    assert rule.reached(history(0.5, 0.9, 0.9005, 0.8, 0.9009))  # +0.09 points: a plateau
    assert not rule.reached(history(0.5, 0.9, 0.9, 0.8, 0.9011))  # +0.11 points: progress
    assert rule.reached(history(0.5, 0.9, 0.7, 0.6, 0.8))  # worse than the best before: a plateau
    assert rule.reached([{"round": 0}, *history(0.5, 0.5, 0.5, 0.5)])  # records without the metric skipped
    assert not Plateau(3, metric="local_accuracy").reached(history(0.5, 0.5, 0.5, 0.5))


def test_the_rule_waits_for_the_evaluation_of_its_first_round():
    flat = history(0.5, 0.5, 0.5, 0.5, 0.5, 0.5)  # rounds 0-5, no progress at all
    assert Plateau(3).reached(flat[:5])
    assert not Plateau(3, not_before=5).reached(flat[:5])  # round 4 evaluated: too early
    assert Plateau(3, not_before=5).reached(flat)
    # a record of round 5 without the metric (an evaluation skipped) does not count as evaluated
    assert not Plateau(3, not_before=5).reached([*flat[:5], {"round": 5}])


@pytest.mark.integration
def test_apple_is_judged_only_after_its_lambda_schedule(tmp_path, fast_config):
    """APPLE's proximal weight lambda(r) falls to 0 at round L*R: a plateau inside the schedule is
    no convergence (on MNIST it stopped APPLE at round 34 of its 40-round schedule)."""
    from pflkit.federation.runner import plateau_rule
    from pflkit.methods import build_algorithm

    cfg = load_config(
        None,
        [
            *fast_config,
            "rounds=50",
            'algorithms=["apple", "fedavg"]',
            "plateau_evaluations=2",
            "plateau_points=100",
            "apple.L=0.1",
        ],
    )
    units = [("body", ["w"]), ("head", ["v"])]
    algs = {n: build_algorithm(n, cfg.algorithm_sections(), cfg.train, units) for n in cfg.algorithms}
    assert plateau_rule(cfg, algs["apple"]).not_before == 5  # ceil(0.1 x 50)
    assert plateau_rule(cfg, algs["fedavg"]).not_before == 0
    cfg = load_config(
        None,
        [
            *fast_config,
            "rounds=50",
            'algorithms=["apple"]',
            "plateau_evaluations=2",
            "plateau_points=100",
            "apple.L=0.1",
        ],
    )
    run_experiment(cfg, tmp_path / "a", progress=False, echo=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    # judged first at the evaluation of round 5 (its first round with lambda = 0), trained on to 6, whose
    # evaluation is the final one; without the wait: [0, 1, 2, 3]
    assert [r["round"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    assert records[-1]["stopped"] == "plateau"


@pytest.mark.integration
def test_a_run_stops_on_its_plateau_and_says_so(tmp_path, fast_config):
    cfg = load_config(
        None, [*fast_config, "rounds=50", 'algorithms=["fedavg"]', "plateau_evaluations=2", "plateau_points=100"]
    )  # any change is "no progress": stops after 3 evaluations
    summary = run_experiment(cfg, tmp_path / "a", progress=False, echo=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert records[-1]["stopped"] == "plateau" and "stopped" not in records[-2]
    assert summary["fedavg"]["seeds"]["0"]["rounds"] == 3
    # resuming a stopped run changes nothing
    resume_experiment(tmp_path / "a", progress=False, echo=lambda s: None)
    assert len((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()) == 4


def test_plateau_settings_are_checked():
    with pytest.raises(Exception, match="plateau_evaluations"):
        load_config(None, ["plateau_evaluations=0"])
    with pytest.raises(Exception, match="plateau_metric"):
        load_config(None, ["plateau_metric=loss"])

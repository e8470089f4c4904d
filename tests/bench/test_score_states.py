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

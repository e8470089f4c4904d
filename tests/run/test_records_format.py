"""A run resumes under any pflkit version that writes the same records format (run.json
"records_format"; a folder without it is format 1), and only there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pflkit import __version__
from pflkit.config import load_config
from pflkit.federation import ResultsFolder
from pflkit.federation.results import RECORDS_FORMAT
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.support.runs import InterruptAfter

TINY = ["dataset=synthetic", "num_clients=4", "alpha=0.5", "rounds=2", 'algorithms=["fedavg", "fedala"]']


def interrupted(out: Path) -> Path:
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            load_config(None, TINY), out, progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedala", 1)]
        )
    return out


def rewrite_status(out: Path, **changes) -> None:
    status = json.loads((out / "run.json").read_text())
    status.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del status[key]
    (out / "run.json").write_text(json.dumps(status))


def test_run_json_names_the_records_format_and_the_version(tmp_path) -> None:
    status = ResultsFolder(interrupted(tmp_path / "run")).status()
    assert status["records_format"] == RECORDS_FORMAT == 1
    assert status["pflkit_version"] == __version__


@pytest.mark.parametrize(
    "changes",
    [{"pflkit_version": "0.0.1"}, {"pflkit_version": "0.2.0"}, {"pflkit_version": "0.1.0", "records_format": None}],
    ids=["older version", "newer version", "no records format (format 1)"],
)
def test_a_run_of_another_version_in_the_same_format_resumes(tmp_path, changes) -> None:
    out = interrupted(tmp_path / "run")
    rewrite_status(out, **changes)
    summary = resume_experiment(out, progress=False, echo=lambda s: None)
    assert set(summary) == {"fedavg", "fedala"}
    status = ResultsFolder(out).status()
    assert status["status"] == "complete" and status["records_format"] == RECORDS_FORMAT


def test_a_run_of_another_records_format_is_refused_and_left_alone(tmp_path) -> None:
    out = interrupted(tmp_path / "run")
    rewrite_status(out, records_format=RECORDS_FORMAT + 1, pflkit_version="9.0.0")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    with pytest.raises(RuntimeError, match=f"records of format {RECORDS_FORMAT + 1} \\(written by pflkit 9.0.0\\)"):
        resume_experiment(out, progress=False, echo=lambda s: None)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"} == before

"""pflkit sweep: grids of runs, resumable cell by cell, with a table of a summary metric."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.config import ConfigError, load_config
from pflkit.run.sweep import plan_sweep, run_sweep, split_axes
from tests.support.paths import REPO

BASE = ["rounds=2", "num_clients=6", 'algorithms=["fedavg", "fedala"]']
GRID = ["fedala.p=[1,2]", "fedala.sample_fraction=[0.05,0.1]"]


def test_split_axes_tells_sweeps_from_list_keys() -> None:
    fixed, axes = split_axes(["fedala.p=[1,2]", 'algorithms=["fedavg"]', "seeds=[[0],[1,2]]", "rounds=3"])
    assert fixed == ['algorithms=["fedavg"]', "rounds=3"]
    assert [(a.key, a.values) for a in axes] == [("fedala.p", [1, 2]), ("seeds", [[0], [1, 2]])]
    with pytest.raises(ConfigError, match="at least one key with a list"):
        split_axes(["rounds=3"])
    with pytest.raises(ConfigError, match="list of values is empty"):
        split_axes(["fedala.p=[]"])


@pytest.mark.integration
def test_a_2x2_sweep_resumes_after_a_kill_without_rerunning_finished_cells(tmp_path) -> None:
    parent = tmp_path / "sweep"
    calls = {"n": 0}

    class KillThirdCell:
        def on_record(self, state, record) -> None:
            if state.algorithm == "fedavg" and record["round"] == 0:
                calls["n"] += 1
            if calls["n"] == 3 and state.algorithm == "fedala" and record["round"] == 1:
                raise KeyboardInterrupt  # the third cell dies during its second method

    with pytest.raises(KeyboardInterrupt):
        run_sweep(None, BASE + GRID, parent, progress=False, echo=lambda s: None, callbacks=[KillThirdCell()])
    done = {
        p.name: p.joinpath("summary.json").stat().st_mtime_ns
        for p in parent.iterdir()
        if p.joinpath("summary.json").is_file()
    }
    assert sorted(done) == ["fedala.p=1,fedala.sample_fraction=0.05", "fedala.p=1,fedala.sample_fraction=0.1"]
    record = run_sweep(None, BASE + GRID, parent, progress=False, echo=lambda s: None)
    for name, mtime in done.items():  # finished cells are neither rerun nor rewritten
        assert parent.joinpath(name, "summary.json").stat().st_mtime_ns == mtime
    assert len(record["cells"]) == 4
    # the resumed cell equals an uninterrupted run of the same cell
    fresh = run_sweep(
        None,
        BASE + ["fedala.p=[2]", "fedala.sample_fraction=[0.05]"],
        tmp_path / "fresh",
        progress=False,
        echo=lambda s: None,
    )
    resumed = next(c for c in record["cells"] if c["folder"] == "fedala.p=2,fedala.sample_fraction=0.05")
    for algorithm in ("fedavg", "fedala"):
        expected = fresh["cells"][0]["summary"][algorithm]["best_accuracy"]
        assert resumed["summary"][algorithm]["best_accuracy"] == expected
    table = (parent / "sweep.md").read_text()
    for cell in record["cells"]:  # the table holds each cell's summary value
        summary = json.loads((parent / cell["folder"] / "summary.json").read_text())
        values = cell["values"]
        row = (
            f"| {values['fedala.p']} | {values['fedala.sample_fraction']} | fedala | "
            f"{100 * summary['fedala']['best_accuracy']:.2f} |"
        )
        assert row in table
    assert (parent / "sweep.png").is_file()


def test_sweep_cli_rejects_bad_grids(tmp_path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["sweep", "fedala.pp=[1,2]", "--out", str(tmp_path / "a")])
    assert result.exit_code == 2 and "fedala.pp: unknown key" in result.output
    result = runner.invoke(main, ["sweep", "rounds=2", "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and "at least one key with a list of values" in result.output
    result = runner.invoke(main, ["sweep", "fedala.p=[]", "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "list of values is empty" in result.output
    assert not (tmp_path / "a").exists()  # nothing is run or created when a cell's config is bad


@pytest.mark.integration
def test_a_cell_run_with_another_config_is_not_reused(tmp_path) -> None:
    run_sweep(
        None,
        ["rounds=1", "num_clients=4", 'algorithms=["fedavg"]', "lr=[0.1]"],
        tmp_path,
        progress=False,
        echo=lambda s: None,
    )
    with pytest.raises(ConfigError, match="was run with another config"):
        run_sweep(
            None,
            ["rounds=2", "num_clients=4", 'algorithms=["fedavg"]', "lr=[0.1]"],
            tmp_path,
            progress=False,
            echo=lambda s: None,
        )


@pytest.mark.parametrize("path", sorted(REPO.joinpath("configs", "paper").glob("*-sweep.toml")), ids=lambda p: p.stem)
def test_paper_sweep_files_plan_their_grids(path) -> None:
    fixed, axes, cells = plan_sweep(str(path), ["data_dir='/x'"])
    assert len(axes) == 1 and axes[0].key in ("fedala.p", "fedala.sample_fraction")
    assert len(cells) == len(axes[0].values) and all(c.algorithms == ["fedala"] for _, c in cells)
    with pytest.raises(ConfigError, match="is a sweep file"):
        load_config(path, ["data_dir='/x'"])


@pytest.mark.integration
def test_a_cell_with_an_unreadable_run_json_fails_clearly_and_the_sweep_goes_on(tmp_path) -> None:
    """A finished cell whose run.json was damaged is not trusted as finished (nor resumed blindly): it
    is reported failed naming the file, and the sweep finishes the others."""
    grid = ["rounds=1", "num_clients=4", 'algorithms=["fedavg"]', "lr=[0.05,0.1]"]
    first = run_sweep(None, grid, tmp_path / "s", progress=False, echo=lambda s: None)
    (tmp_path / "s" / "lr=0.05" / "run.json").write_text("{not json")
    lines: list[str] = []
    again = run_sweep(None, grid, tmp_path / "s", progress=False, echo=lines.append)
    assert "run.json is not valid JSON" in again["cells"][0]["error"]
    assert again["cells"][1]["summary"] == first["cells"][1]["summary"]
    assert any(line.startswith("sweep cell lr=0.05 failed") for line in lines)


def test_a_command_line_list_replaces_the_sweep_files_list(tmp_path):
    from pflkit.run.sweep import plan_sweep

    path = tmp_path / "sweep.toml"
    path.write_text('rounds = 2\n[sweep]\nalgorithms = [["fedavg"], ["fedprox"], ["ditto"]]\nseeds = [[0]]\n')
    _, axes, cells = plan_sweep(str(path), ["seeds=[[1],[2]]"])
    assert [(a.key, a.values) for a in axes] == [
        ("algorithms", [["fedavg"], ["fedprox"], ["ditto"]]),
        ("seeds", [[1], [2]]),
    ]
    _, axes, cells = plan_sweep(str(path), ['algorithms=["fedala"]'])  # a fixed value: no longer an axis
    assert [a.key for a in axes] == ["seeds"] and cells[0][1].algorithms == ["fedala"]


@pytest.mark.integration
def test_a_cell_run_with_other_workers_is_the_same_cell(tmp_path):
    """run.workers (and the other execution keys) change no number: a finished cell is reused, an
    unfinished one continued, whatever the machine's worker count."""
    grid = ["rounds=1", "num_clients=4", 'algorithms=["fedavg"]', "lr=[0.1]"]
    first = run_sweep(None, [*grid, "workers=1"], tmp_path / "s", progress=False, echo=lambda s: None)
    again = run_sweep(
        None, [*grid, "workers=2", "checkpoint_every=3"], tmp_path / "s", progress=False, echo=lambda s: None
    )
    assert again["cells"][0]["summary"] == first["cells"][0]["summary"]
    with pytest.raises(ConfigError, match="differs in train.lr_decay"):
        run_sweep(None, [*grid, "lr_decay=0.5"], tmp_path / "s", progress=False, echo=lambda s: None)

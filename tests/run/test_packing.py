"""pflkit pack / unpack: a complete results folder as one records.tar.xz (config.toml included),
read by every reader exactly as the plain folder, never written, and restored byte for byte."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.config import ConfigError, load_config
from pflkit.federation import ResultsFolder
from pflkit.federation.archive import ARCHIVE, PACKED_SWEEP_RECORD, read_archive, write_archive
from pflkit.federation.packing import PackError, pack_folder, read_sweep_record, unpack_folder
from pflkit.federation.results import PackedFolderError
from pflkit.run.experiment import resume_experiment, run_experiment
from pflkit.run.report import build_report
from pflkit.run.sweep import run_sweep
from tests.support.runs import DivergeAfter, InterruptAfter

TINY = ["dataset=synthetic", "num_clients=4", "alpha=0.5", "rounds=2", 'algorithms=["fedavg", "fedala"]']


def files(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` but the lock, by relative path."""
    kept = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"]
    return {str(p.relative_to(folder)): p.read_bytes() for p in kept}


def top_files(folder: Path) -> list[str]:
    """The plain files of a folder's top level but its lock (a run leaves it; it is no record)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != ".lock")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packing") / "run"
    run_experiment(load_config(None, TINY), out, progress=False, echo=lambda s: None)
    return out


@pytest.fixture
def packed(finished, tmp_path) -> tuple[Path, dict[str, bytes]]:
    """A copy of the finished run, packed; with the plain copy's files."""
    folder = tmp_path / "cell"
    subprocess.run(["cp", "-a", str(finished), str(folder)], check=True)
    before = files(folder)
    result = CliRunner().invoke(main, ["pack", str(tmp_path)])
    assert result.exit_code == 0, result.output
    return folder, before


def test_pack_leaves_one_archive_and_unpack_restores_every_byte(finished, packed) -> None:
    folder, before = packed
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == [ARCHIVE]  # nor config.toml, nor the lock
    assert "config.toml" in read_archive(folder / ARCHIVE)
    assert (folder / "checkpoints").is_dir() and (folder / "plots").is_dir()  # left as they were
    assert "already packed" in CliRunner().invoke(main, ["pack", str(folder)]).output
    result = CliRunner().invoke(main, ["unpack", str(folder.parent)])
    assert result.exit_code == 0, result.output
    assert files(folder) == before
    assert int((folder / "config.toml").stat().st_mtime) == int((finished / "config.toml").stat().st_mtime)
    pack_folder(folder)
    first = (folder / ARCHIVE).read_bytes()
    unpack_folder(folder)
    pack_folder(folder)
    assert (folder / ARCHIVE).read_bytes() == first  # the same archive every time: mtimes come back too


def test_a_packed_folder_reads_as_the_plain_one(finished, packed, tmp_path) -> None:
    folder, _ = packed
    plain, cell = ResultsFolder(finished), ResultsFolder(folder)
    assert cell.packed and not plain.packed
    assert cell.status() == plain.status()
    assert cell.records() == plain.records() and cell.records()
    assert cell.histories() == plain.histories()
    assert cell.summary() == plain.summary()
    assert cell.partition(0) == plain.partition(0) == json.loads(plain.partition_path(0).read_text())
    assert cell.has_config() and cell.config_text() == plain.config_path.read_text()
    assert cell.config_table() == plain.config_table()
    assert cell.load_config() == plain.load_config() == load_config(plain.config_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    md_plain, _ = build_report([finished], tmp_path / "a")
    md_packed, _ = build_report([folder], tmp_path / "b")
    assert md_packed.read_text().replace("cell", "run") == md_plain.read_text()
    result = CliRunner().invoke(main, ["plot", "ala", str(folder)])
    assert result.exit_code == 0, result.output
    assert (folder / "plots" / "ala.png").is_file()
    assert top_files(folder) == [ARCHIVE]


def test_a_complete_packed_folder_resumes_as_a_no_op_and_is_never_written(packed) -> None:
    folder, _ = packed
    archive = (folder / ARCHIVE).read_bytes()
    summary = resume_experiment(folder, progress=False, echo=lambda s: None)
    assert summary == ResultsFolder(folder).summary()
    assert (folder / ARCHIVE).read_bytes() == archive
    with pytest.raises(PackedFolderError, match="pflkit unpack"):
        ResultsFolder(folder).append_record({"algorithm": "fedavg", "seed": 0, "round": 9})
    result = CliRunner().invoke(main, ["run", *TINY, "--out", str(folder)])
    assert result.exit_code != 0 and "already exists" in result.output
    result = CliRunner().invoke(main, ["run", "--resume", str(folder)])
    assert result.exit_code == 0 and "nothing to resume" in result.output, result.output
    assert (folder / ARCHIVE).read_bytes() == archive and top_files(folder) == [ARCHIVE]


def test_a_packed_folders_config_toml_still_names_its_config(finished, packed, tmp_path) -> None:
    folder, _ = packed
    saved = folder / "config.toml"
    result = CliRunner().invoke(main, ["config", str(saved)])  # read from the archive
    assert result.exit_code == 0, result.output
    assert result.output == (finished / "config.toml").read_text()
    result = CliRunner().invoke(main, ["config", str(saved), "rounds=1"])
    assert result.exit_code == 0 and "rounds = 1\n" in result.output, result.output
    with pytest.raises(ConfigError, match=f"pflkit unpack {folder}"):  # readers of a file by its path
        load_config(saved)
    rerun = tmp_path / "rerun"
    result = CliRunner().invoke(main, ["run", str(saved), "--out", str(rerun), "--quiet"])
    assert result.exit_code == 0, result.output
    assert ResultsFolder(rerun).config_text() == ResultsFolder(folder).config_text()  # the same config, run again
    assert ResultsFolder(rerun).status()["status"] == "complete"


def test_pack_refuses_an_unfinished_run_and_a_packed_unfinished_run_is_not_resumed(tmp_path) -> None:
    out = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            load_config(None, TINY), out, progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedala", 1)]
        )
    result = CliRunner().invoke(main, ["pack", str(tmp_path)])
    assert result.exit_code == 2
    assert "refused" in result.output and "neither complete nor failed" in result.output
    assert not (out / ARCHIVE).exists() and (out / "metrics.jsonl").is_file()
    with pytest.raises(PackError, match="neither complete nor failed"):
        pack_folder(out)
    # packed by hand all the same: a resume refuses, naming pflkit unpack, and writes nothing
    run = ResultsFolder(out)
    names = ["run.json", "metrics.jsonl", "partition-seed0.json"]
    write_archive(run.archive_path, {n: ((out / n).read_bytes(), 0) for n in names})
    for name in names:
        (out / name).unlink()
    for resume in (
        lambda: resume_experiment(out, progress=False, echo=lambda s: None),
        lambda: run_experiment(load_config(None, TINY), out, resume=True, progress=False, echo=lambda s: None),
    ):
        with pytest.raises(PackedFolderError, match=f"pflkit unpack {out}"):
            resume()
    assert top_files(out) == ["config.toml", ARCHIVE]
    result = CliRunner().invoke(main, ["run", "--resume", str(out)])
    assert result.exit_code == 2 and "pflkit unpack" in result.output


def test_a_failed_run_packs_with_its_error_and_is_not_resumed_packed(tmp_path) -> None:
    """A run that stopped on a NaN loss is a result (a diverging method): its records pack, read back
    as they were, and a resume of the packed folder is refused as for any packed unended run."""
    from pflkit.functional.training import NonFiniteLossError

    out = tmp_path / "diverged"
    with pytest.raises(NonFiniteLossError):
        run_experiment(load_config(None, TINY), out, progress=False, echo=lambda s: None, callbacks=[DivergeAfter(1)])
    before = {name: (out / name).read_bytes() for name in top_files(out)}
    assert "packed" in pack_folder(out)
    assert top_files(out) == [ARCHIVE]
    run = ResultsFolder(out)
    assert run.status()["status"] == "failed" and "training loss became nan" in run.status()["error"]
    assert {name: data for name, (data, _) in run.archived().items()} == before
    with pytest.raises(PackedFolderError, match=f"pflkit unpack {out}"):
        resume_experiment(out, progress=False, echo=lambda s: None)
    unpack_folder(out)
    assert {name: (out / name).read_bytes() for name in top_files(out)} == before


def test_pack_finishes_an_interrupted_pack_and_refuses_a_differing_copy(packed) -> None:
    folder, before = packed
    (folder / "summary.json").write_bytes(before["summary.json"])  # left by a pack stopped before removing it
    assert pack_folder(folder).endswith("already packed")
    assert not (folder / "summary.json").exists()
    (folder / "summary.json").write_text("{}\n")
    with pytest.raises(PackError, match="not the copy"):
        pack_folder(folder)
    with pytest.raises(PackError, match="differs"):
        unpack_folder(folder)


def test_pack_moves_a_config_left_out_of_an_archive_into_it(packed) -> None:
    folder, before = packed
    members = read_archive(folder / ARCHIVE)
    config = members.pop("config.toml")
    write_archive(folder / ARCHIVE, members)  # packed by an earlier pflkit: config.toml stayed plain
    (folder / "config.toml").write_bytes(config[0])
    assert ResultsFolder(folder).config_text() == before["config.toml"].decode()
    line = pack_folder(folder)
    assert line == f"{folder}: moved config.toml into {ARCHIVE} (now {(folder / ARCHIVE).stat().st_size} bytes)"
    assert top_files(folder) == [ARCHIVE] and read_archive(folder / ARCHIVE)["config.toml"][0] == before["config.toml"]
    assert pack_folder(folder).endswith("already packed")
    unpack_folder(folder)
    assert files(folder) == before


@pytest.mark.integration
def test_a_sweep_skips_a_packed_complete_cell_and_reports_from_packed_files(tmp_path) -> None:
    grid = ["dataset=synthetic", "rounds=1", 'algorithms=["fedavg"]', "num_clients=[3,4]"]
    parent = tmp_path / "sweep"
    first = run_sweep(None, grid, parent, progress=False, echo=lambda s: None)
    result = CliRunner().invoke(main, ["pack", str(parent)])
    assert result.exit_code == 0, result.output
    assert (parent / PACKED_SWEEP_RECORD).is_file() and not (parent / "sweep.json").exists()
    assert read_sweep_record(parent)["cells"] == first["cells"]
    md, _ = build_report([parent], tmp_path / "report")  # the sweep's section: from sweep.json.xz
    assert "sweep sweep: num_clients" in md.read_text()
    archives = {p: p.read_bytes() for p in parent.rglob(ARCHIVE)}
    assert len(archives) == 2
    with pytest.raises(ConfigError, match="was run with another config"):  # the packed cells' configs are read
        run_sweep(None, [*grid[:-1], "rounds=2", grid[-1]], parent, progress=False, echo=lambda s: None)
    again = run_sweep(None, grid, parent, progress=False, echo=lambda s: None)
    assert again["cells"] == first["cells"]
    assert {p: p.read_bytes() for p in parent.rglob(ARCHIVE)} == archives  # skipped: nothing rewritten
    assert not (parent / PACKED_SWEEP_RECORD).exists()  # the new sweep.json replaced the packed one
    assert CliRunner().invoke(main, ["unpack", str(parent)]).exit_code == 0
    assert not list(parent.rglob(ARCHIVE))


def test_pack_refuses_a_folder_a_run_is_writing(finished, tmp_path) -> None:
    folder = tmp_path / "busy"
    subprocess.run(["cp", "-a", str(finished), str(folder)], check=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, b"pflkit pid 1234 on host h", 0)
        result = CliRunner().invoke(main, ["pack", str(folder)])
        assert result.exit_code == 2 and "in use by pflkit pid 1234" in result.output
        assert not (folder / ARCHIVE).exists() and (folder / "metrics.jsonl").is_file()
    finally:
        os.close(fd)

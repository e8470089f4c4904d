"""What a finished run or sweep prints last (its folder, its plots, the commands that come next), and
the help texts: every config they name exists, and they speak of the product only."""

from __future__ import annotations

import re
from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner

from pflkit.cli import main
from tests.support.paths import REPO

FAST = ["dataset=synthetic", "num_clients=4", "alpha=0.5", "rounds=1"]


@pytest.mark.integration
def test_a_finished_run_names_its_plots_and_the_commands_that_come_next(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    out = tmp_path / "quick"
    args = ["run", *FAST, 'algorithms=["fedavg","fedala"]', "tracker=tensorboard", "--out", str(out), "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    tail = lines[lines.index(f"results: {out}") :]
    assert len(tail) == 6, tail
    assert tail[1].startswith(f"plots:   {out / 'plots'}/ (accuracy.png, partition-seed0.png")
    assert tail[2] == "next:"
    assert tail[3].startswith(f"  pflkit report {out} --out reports/quick")
    assert tail[4].startswith(f"  pflkit plot ala {out}")  # fedala = fedavg+ala
    assert tail[5] == f"  tensorboard --logdir {out / 'tensorboard'}"
    # the commands it names work
    report = CliRunner().invoke(main, ["report", str(out), "--out", str(tmp_path / "reports" / "quick")])
    assert report.exit_code == 0, report.output
    assert CliRunner().invoke(main, ["plot", "ala", str(out)]).exit_code == 0


@pytest.mark.integration
def test_a_finished_sweep_names_its_table_and_the_report_command(tmp_path) -> None:
    out = tmp_path / "sp"
    result = CliRunner().invoke(
        main, ["sweep", *FAST, 'algorithms=["fedavg"]', "seeds=[[0],[1]]", "--out", str(out), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"sweep:   {out} (sweep.md, sweep.png; one results folder per cell)" in lines
    assert any(line.startswith(f"  pflkit report {out} --out reports/sp") for line in lines)
    assert not any("tensorboard" in line for line in lines)


def _commands(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """Every command's path and its whole help page."""
    yield path, CliRunner().invoke(main, [*path, "--help"], terminal_width=200).output
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))


HELP = dict(_commands(main))


def test_every_config_a_help_text_names_exists() -> None:
    named = {(path, m) for path, text in HELP.items() for m in re.findall(r"configs/[\w./-]+\.toml", text)}
    assert named, "no help text names a config: the check below checks nothing"
    missing = [
        f"pflkit {' '.join(path)} --help names {config}" for path, config in named if not (REPO / config).is_file()
    ]
    assert not missing, missing


# how the project was developed (its working notes' words and tags), not what the product does
DEVELOPMENT_WORDS = re.compile(
    r"(?i:\bsession\b|\blease\b|\blent\b|\bissue \d|spec §)|\[(?:UNCERTAIN|RECON|REF-CODE|PAPER)\b"
)


def test_help_texts_and_config_keys_speak_of_the_product() -> None:
    keys = CliRunner().invoke(main, ["config", "--keys"]).output
    pages = {" ".join(path) or "pflkit": text for path, text in HELP.items()} | {"config --keys": keys}
    found = [
        f"{page}: {line.strip()}"
        for page, text in pages.items()
        for line in text.splitlines()
        if DEVELOPMENT_WORDS.search(line)
    ]
    assert not found, found

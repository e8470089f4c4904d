"""``pflkit leaderboard``: the one-page leaderboard of the committed result cells."""

from __future__ import annotations

from pathlib import Path

import click

from .app import main
from .common import USER_ERRORS, check_writable_file, fail


@main.command()
@click.option(
    "--results",
    "results_root",
    type=click.Path(path_type=Path),
    default=Path("docs/results"),
    show_default=True,
    help="folder of the result cells (one folder per table, one results folder per method and seed)",
)
@click.option(
    "--costs",
    type=click.Path(path_type=Path),
    default=Path("docs/method-costs-after.json"),
    show_default=True,
    help="per-method round costs relative to FedAvg (benchmarks/method_costs.py's JSON)",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("docs/leaderboard.md"),
    show_default=True,
    help="the Markdown page to write",
)
def leaderboard(results_root: Path, costs: Path, out: Path) -> None:
    """Write the leaderboard page from the result cells: FedALA's Table 7 on MNIST (best accuracy
    mean ± std over seeds, seeds, round of the best, rounds to the plateau, round cost relative to
    FedAvg, the paper's number) and FedACD's and SosicFL's protocol tables. Run at the repository
    root, it reads docs/results and writes docs/leaderboard.md."""
    from ..run.report.leaderboard import write_leaderboard

    try:
        check_writable_file(out)
        write_leaderboard(results_root, out, costs)
    except USER_ERRORS as exc:
        fail(exc)
    click.echo(f"wrote {out}")

"""``pflkit sweep`` and ``pflkit report``."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from .app import main
from .common import USER_ERRORS, _split, check_writable_folder, fail, interrupted


@main.command(
    epilog="""Examples:

\b
    pflkit sweep 'fedala.p=[1,2]' 'fedala.sample_fraction=[0.05,0.1]' 'algorithms=["fedala"]' --out results/sp
    pflkit sweep configs/mnist_fedala.toml data_dir=DIR 'alpha=[0.1,0.5]' --metric best_accuracy --out results/alpha
"""
)
@click.argument("args", nargs=-1)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="parent folder: one results folder per cell, named by its values",
)
@click.option("--metric", default="best_accuracy", show_default=True, help="summary metric of the table and plot")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="local: the cells one after another here; ray: each cell a Ray task "
    "(pip install -e '.[ray]' in a pflkit clone)",
)
@click.option(
    "--address",
    default=None,
    help="--executor ray: the Ray cluster (e.g. 10.0.0.1:6379 or auto); "
    "default: a Ray instance started on this machine. Results must be on storage every node shares",
)
@click.option(
    "--cpus-per-cell",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="--executor ray: CPUs a cell reserves (match the config's run.threads x run.workers)",
)
@click.option(
    "--gpus-per-cell",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="--executor ray: GPUs a cell reserves (1: a cell per GPU; set run.device=cuda)",
)
@click.option(
    "--max-retries",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="--executor ray: runs again of a cell whose worker died, each from its last checkpoint",
)
def sweep(
    args: tuple[str, ...],
    out: Path,
    metric: str,
    quiet: bool,
    executor: str,
    address: str | None,
    cpus_per_cell: float,
    gpus_per_cell: float,
    max_retries: int,
) -> None:
    """Run CONFIG (optional) over every combination of the KEY=[v1,v2,...] overrides; finished
    cells are skipped and an interrupted one resumes when the same command runs again."""
    from ..federation import stop_on_signals
    from ..run.sweep import run_sweep

    metric_words = ["--metric", metric] if metric != "best_accuracy" else []
    ray_options = {
        "--address": address,
        "--cpus-per-cell": cpus_per_cell != 1.0,
        "--gpus-per-cell": gpus_per_cell != 0.0,
        "--max-retries": max_retries != 3,
    }
    if executor == "local" and any(ray_options.values()):
        raise click.UsageError(f"{', '.join(k for k, v in ray_options.items() if v)} go(es) with --executor ray")
    if executor == "ray":
        metric_words += [
            "--executor",
            "ray",
            *(["--address", address] if address else []),
            "--cpus-per-cell",
            f"{cpus_per_cell:g}",
            "--gpus-per-cell",
            f"{gpus_per_cell:g}",
            "--max-retries",
            str(max_retries),
        ]
    words = " ".join(shlex.quote(w) for w in ["pflkit", "sweep", *args, "--out", str(out), *metric_words])
    try:
        check_writable_folder(out)
        config, overrides = _split(args)
        with stop_on_signals():
            record = run_sweep(
                config,
                overrides,
                out,
                metric=metric,
                progress=not quiet,
                echo=click.echo,
                executor=executor,
                address=address,
                cpus_per_cell=cpus_per_cell,
                gpus_per_cell=gpus_per_cell,
                max_retries=max_retries,
            )
    except KeyboardInterrupt as exc:
        interrupted(exc, f"the same command ({words}): finished cells are kept and the interrupted one resumes")
    except USER_ERRORS as exc:
        fail(exc)
    failed = [cell for cell in record["cells"] if "error" in cell]
    if failed:
        names = ", ".join(c["folder"] for c in failed)
        click.echo(
            f"error: {len(failed)} of {len(record['cells'])} cells failed ({names}); their errors are above, "
            f"in {out / 'sweep.md'} and in each cell's run.json",
            err=True,
        )
        sys.exit(1)


@main.command(
    epilog="""\b
Examples:
  pflkit report results/quick results/sp --out report --title "FedALA on digits"
  pflkit report results/sp --out report --name sp   # a sweep folder: its cells in one report
"""
)
@click.argument("folders", nargs=-1, type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("report"),
    show_default=True,
    help="folder for NAME.md (figures beside it, in figures/) and the self-contained NAME.html",
)
@click.option("--name", default="report", show_default=True, help="file name of the report, without suffix")
@click.option("--title", default="pflkit report", show_default=True, help="the report's heading")
@click.option(
    "--intro",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="a Markdown file whose text stands under the heading (the setting, what to read first)",
)
def report(folders: tuple[Path, ...], out: Path, name: str, title: str, intro: Path | None) -> None:
    """Collect results folders and sweep folders into one Markdown file and one HTML page: per
    method mean ± std of the summary metrics, the paper's numbers where the config names its
    table (paper_table), time to accuracy, cost per round and every figure. The command that made
    the report stands at its top."""
    from ..run.report import build_report

    words = ["report", *map(str, folders), "--out", str(out)]
    words += ["--name", name] if name != "report" else []
    words += ["--title", title] if title != "pflkit report" else []
    words += ["--intro", str(intro)] if intro else []
    command = " ".join(["pflkit", *map(shlex.quote, words)])
    try:
        check_writable_folder(out)
        md, page = build_report(
            folders, out, name=name, title=title, command=command, intro=intro.read_text() if intro else None
        )
    except USER_ERRORS as exc:
        fail(exc)
    click.echo(f"wrote {md} and {page}")

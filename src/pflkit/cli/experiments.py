"""``pflkit run``, ``pflkit config`` and ``pflkit algorithms``."""

from __future__ import annotations

import json
from pathlib import Path

import click
import tomli_w

from ..config import describe_keys, to_dict
from .app import main
from .common import USER_ERRORS, _split, check_writable_folder, fail, interrupted, load_cli_config

EPILOG = """\b
Examples:
  pflkit run                                   # the digits demo (5 methods, 20 clients, Dir(0.1))
  pflkit run configs/mnist_fedala.toml data_dir=~/datasets/mnist rounds=50
  pflkit run rounds=3 algorithms='["fedavg","fedala"]' fedala.eta=0.5 --out results/quick
  pflkit run --resume results/quick
"""


@main.command(epilog=EPILOG)
@click.argument("args", nargs=-1)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="results folder (default: results/<name>-<timestamp>)",
)
@click.option(
    "--resume",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="continue the interrupted run in this results folder",
)
@click.option("--quiet", is_flag=True, help="no progress bars")
@click.option(
    "--on",
    "on",
    type=click.Choice(["simulator", "flower-simulation"]),
    default="simulator",
    show_default=True,
    help="simulator: pflkit's engines in this process; flower-simulation: pflkit's "
    "Flower apps as virtual SuperNodes on Flower's Simulation Engine (Ray; pip install -e '.[ray]' in a pflkit clone)",
)
@click.option(
    "--ray-address",
    default=None,
    help="--on flower-simulation: the Ray cluster (HOST:PORT or auto); default: Ray on this machine",
)
def run(
    args: tuple[str, ...], out: Path | None, resume: Path | None, quiet: bool, on: str, ray_address: str | None
) -> None:
    """Run an experiment: [CONFIG.toml] [key=value ...] (no CONFIG: the digits demo)."""
    from ..federation import RunInterrupted, stop_on_signals
    from ..run.experiment import new_results_folder, resume_experiment, run_experiment

    try:
        # Flower's Simulation Engine keeps the main thread: the ServerApp's thread raises the stop itself
        with stop_on_signals(cooperative=on == "flower-simulation"):
            if resume is not None:
                if args or out:
                    raise click.UsageError("--resume takes no CONFIG, overrides or --out: the folder's config is used")
                if on != "simulator" or ray_address:
                    raise click.UsageError(
                        "--resume continues a simulator run; a flower-simulation run continues "
                        "when its command (same --out) runs again"
                    )
                resume_experiment(resume, progress=not quiet, echo=click.echo)
                return
            config_path, overrides = _split(args)
            config = load_cli_config(config_path, overrides)
            check_writable_folder(out if out is not None else Path("results"))
            if on == "flower-simulation":
                from ..flower.simulation import FLOWER_LOG, run_on_flower_simulation
                from ..reporting import format_table
                from ..run.next_steps import run_lines

                folder = out if out is not None else new_results_folder(config.name)
                try:
                    summary = run_on_flower_simulation(config, folder, ray_address=ray_address)
                except BaseException:
                    if (folder / FLOWER_LOG).is_file():
                        click.echo(f"Flower's full log: {folder / FLOWER_LOG}", err=True)
                    raise
                click.echo(format_table(summary))
                click.echo("\n".join(run_lines(folder, config)))
                click.echo(f"Flower's full log: {folder / FLOWER_LOG}")
                return
            if ray_address:
                raise click.UsageError("--ray-address goes with --on flower-simulation")
            run_experiment(config, out, progress=not quiet, echo=click.echo)
    except RunInterrupted as exc:
        interrupted(
            exc,
            f"pflkit run --resume {exc.folder}" if on == "simulator" else f"the same command with --out {exc.folder}",
        )
    except USER_ERRORS as exc:
        fail(exc)


@main.command(
    epilog="""\b
Examples:
  pflkit config configs/mnist_fedala.toml data_dir=DIR rounds=10   # the TOML that run would use
  pflkit config --keys                                             # every key, its default, its meaning
"""
)
@click.argument("args", nargs=-1)
@click.option(
    "--keys",
    is_flag=True,
    help="list every key instead: its section, the flat alias that also sets it, its default and what it means",
)
def config(args: tuple[str, ...], keys: bool) -> None:
    """Print the resolved configuration of [CONFIG.toml] [key=value ...] as TOML (sections
    [partition], [train], [run], ...; the flat keys of older configs, such as lr or num_clients,
    are aliases of their section's keys)."""
    if keys:
        if args:
            raise click.UsageError("--keys takes no CONFIG or overrides")
        for key, alias, default, meaning in describe_keys():
            shown = "unset" if default is None else json.dumps(default)
            line = f"{key}" + (f" (flat: {alias})" if alias else "") + f" = {shown}"
            click.echo(line + (f"\n    {meaning}" if meaning else ""))
        return
    try:
        config_path, overrides = _split(args)
        click.echo(tomli_w.dumps(to_dict(load_cli_config(config_path, overrides))), nl=False)
    except USER_ERRORS as exc:
        fail(exc)


@main.command(epilog="\b\nExamples:\n  pflkit algorithms\n  pflkit algorithms --json")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per method, for machines")
def algorithms(as_json: bool) -> None:
    """List the methods ``algorithms = [...]`` accepts: name, method and paper, global or
    personalised, the scored model, how the vmap engine runs it, whether ``NAME+ala`` exists."""
    from ..catalogue import format_listing, listing

    rows, problems = listing()
    if as_json:
        click.echo(json.dumps(rows, indent=1))
    else:
        click.echo(format_listing(rows))
        click.echo("\nNAME+ala: ALA initialises the model before NAME's training, for every NAME marked +ala yes.")
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)

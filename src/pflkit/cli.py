"""The ``pflkit`` command line."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import click
import tomli_w

from .config import describe_keys, load_config, to_dict
from .data.partition.spec import TestSet

EPILOG = """\b
Examples:
  pflkit run                                   # the digits demo (5 methods, 20 clients, Dir(0.1))
  pflkit run configs/mnist_fedala.toml data_dir=../shared/datasets/mnist rounds=50
  pflkit run rounds=3 algorithms='["fedavg","fedala"]' fedala.eta=0.5 --out results/quick
  pflkit run --resume results/quick
"""


_OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*=")


def _split(args: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """One CONFIG.toml and key=value overrides; a path whose folder names hold ``=`` (a sweep
    cell's ``results/sp/fedala.p=2/config.toml``) is the config, not an override."""
    config = None
    overrides = []
    for arg in args:
        if _OVERRIDE.match(arg) and not (arg.endswith(".toml") and Path(arg).is_file()):
            overrides.append(arg)
        elif config is None:
            config = arg
        else:
            raise click.UsageError(f"unexpected argument {arg!r}: give one CONFIG.toml and key=value overrides")
    return config, overrides


# What bad input raises (configs, data files, partitions, NaN losses, folders): reported as one
# "error: ..." line and exit status 2; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, RuntimeError, OSError, FloatingPointError)


def check_writable_file(path: Path) -> None:
    """OSError naming ``path`` unless a file can be written there (checked before any work)."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: give a file name for the report")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist: create it first, or write the report elsewhere")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PermissionError(f"{path} cannot be written (no permission)")


def fail(exc: BaseException) -> None:
    if click.get_current_context().find_root().params.get("debug"):
        raise exc
    click.echo(f"error: {exc}", err=True)
    sys.exit(2)


def interrupted(exc: KeyboardInterrupt, resume: str) -> None:
    reason = str(exc) or "interrupted (Ctrl-C)"
    click.echo(f"\n{reason}: the rounds up to the last checkpoint are kept; continue with: {resume}", err=True)
    sys.exit(130)


@click.group()
@click.version_option(package_name="pflkit")
@click.option("--debug", is_flag=True, help="show the traceback of errors instead of one line")
def main(debug: bool) -> None:
    """Personalized federated learning: FedALA and its baselines, simulated or on Flower."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@main.command(epilog=EPILOG)
@click.argument("args", nargs=-1)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="results folder (default: results/<name>-<timestamp>)")
@click.option("--resume", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="continue the interrupted run in this results folder")
@click.option("--quiet", is_flag=True, help="no progress bars")
@click.option("--on", "on", type=click.Choice(["simulator", "flower-simulation"]), default="simulator",
              show_default=True, help="simulator: pflkit's engines in this process; flower-simulation: pflkit's "
              "Flower apps as virtual SuperNodes on Flower's Simulation Engine (Ray; pip install 'pflkit[ray]')")
@click.option("--ray-address", default=None, help="--on flower-simulation: the Ray cluster (HOST:PORT or auto); "
              "default: Ray on this machine")
def run(args: tuple[str, ...], out: Path | None, resume: Path | None, quiet: bool, on: str,
        ray_address: str | None) -> None:
    """Run an experiment: [CONFIG.toml] [key=value ...] (no CONFIG: the digits demo)."""
    from .federation import RunInterrupted, stop_on_signals
    from .run.experiment import new_results_folder, resume_experiment, run_experiment

    try:
        # Flower's Simulation Engine keeps the main thread: the ServerApp's thread raises the stop itself
        with stop_on_signals(cooperative=on == "flower-simulation"):
            if resume is not None:
                if args or out:
                    raise click.UsageError("--resume takes no CONFIG, overrides or --out: the folder's config is used")
                if on != "simulator" or ray_address:
                    raise click.UsageError("--resume continues a simulator run; a flower-simulation run continues "
                                           "when its command (same --out) runs again")
                resume_experiment(resume, progress=not quiet, echo=click.echo)
                return
            config_path, overrides = _split(args)
            config = load_config(config_path, overrides)
            if on == "flower-simulation":
                from .flower.simulation import run_on_flower_simulation
                from .reporting import format_table

                folder = out if out is not None else new_results_folder(config.name)
                click.echo(format_table(run_on_flower_simulation(config, folder, ray_address=ray_address)))
                click.echo(f"results: {folder}")
                return
            if ray_address:
                raise click.UsageError("--ray-address goes with --on flower-simulation")
            run_experiment(config, out, progress=not quiet, echo=click.echo)
    except RunInterrupted as exc:
        interrupted(exc, f"pflkit run --resume {exc.folder}" if on == "simulator" else
                    f"the same command with --out {exc.folder}")
    except USER_ERRORS as exc:
        fail(exc)


@main.command()
@click.argument("args", nargs=-1)
@click.option("--keys", is_flag=True, help="list every key instead: its section, the flat alias that also sets it, "
              "its default and what it means")
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
        click.echo(tomli_w.dumps(to_dict(load_config(config_path, overrides))), nl=False)
    except USER_ERRORS as exc:
        fail(exc)


@main.command()
@click.option("--data-dir", default=None, help="MNIST folder (IDX files); default: an MNIST-shaped stand-in")
@click.option("--clients", default="20", show_default=True, help="comma-separated client counts")
@click.option("--engines", default="loop,parallel", show_default=True, help="comma-separated engines")
@click.option("--algorithms", "algos", default="fedavg,fedala", show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=4, show_default=True,
              help="rounds per engine (round 2 = ALA start phase)")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="parallel engine workers (default: all cores)")
@click.option("--device", default="cpu", show_default=True)
@click.option("--test-set", type=click.Choice(["client_split", "official"]), default="client_split",
              show_default=True, help="official: also time the global model's evaluation on the official test set")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench.json"),
              show_default=True, help="JSON report")
@click.option("--scale", is_flag=True, help="client-count scaling at a fixed total of samples: s/round, per-client "
              "overhead, peak memory and state bytes on disk per client count (defaults: --clients "
              "100,1000,10000 --engines parallel,vmap --rounds 3)")
@click.option("--participants", type=click.IntRange(min=1), default=1000, show_default=True,
              help="--scale: clients trained per round at most (more clients: that many sampled)")
def bench(data_dir: str | None, clients: str, engines: str, algos: str, rounds: int, workers: int | None,
          device: str, test_set: TestSet, out: Path, scale: bool, participants: int) -> None:
    """Time FedAvg and FedALA rounds on each engine (MNIST CNN, Dir(0.1), batch 10, lr 0.1).

    \b
    GPU: pflkit bench --device cuda --engines loop,vmap --clients 20,1000 --data-dir DIR"""
    from .bench import BenchSettings, format_report, run_bench, save_report

    source = click.get_current_context().get_parameter_source
    default = click.core.ParameterSource.DEFAULT
    try:
        counts = [int(c) for c in clients.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {clients!r}",
                                 param_hint="--clients") from None
    if min(counts) < 1:
        raise click.BadParameter(f"client counts must be at least 1, got {clients!r}", param_hint="--clients")
    try:  # before minutes of work: the device exists and the report can be written
        from .federation.preparation import resolve_device

        resolve_device(device)
        check_writable_file(out)
    except USER_ERRORS as exc:
        fail(exc)
    unknown = sorted(set(engines.split(",")) - {"loop", "parallel", "vmap"})
    if unknown:
        raise click.BadParameter(f"unknown engine(s) {', '.join(unknown)}; choose from loop, parallel, vmap",
                                 param_hint="--engines")
    if scale:
        from .bench_scale import ScaleSettings, format_scale_report, run_scale_bench

        given: dict[str, Any] = {"clients": counts, "engines": engines.split(","), "rounds": rounds}
        scale_settings = ScaleSettings(
            data_dir=data_dir, algorithms=algos.split(","), participants=participants, workers=workers,
            device=device, **{key: value for key, value in given.items() if source(key) != default})
        run, show = (lambda: run_scale_bench(scale_settings, echo=click.echo)), format_scale_report
    else:
        if rounds < 2:
            raise click.BadParameter(f"needs at least 2 rounds (round 1 warms up, the median is over the later "
                                     f"ones), got {rounds}", param_hint="--rounds")
        settings = BenchSettings(data_dir=data_dir, clients=counts, engines=engines.split(","),
                                 algorithms=algos.split(","), rounds=rounds, workers=workers, device=device,
                                 test_set=test_set)
        run, show = (lambda: run_bench(settings, echo=click.echo)), format_report
    try:
        report = run()
    except USER_ERRORS as exc:
        fail(exc)
    save_report(report, out)
    click.echo(show(report))
    click.echo(f"report: {out}")


@main.command()
@click.argument("name")
@click.argument("data_dir", type=click.Path(file_okay=False, path_type=Path))
def download(name: str, data_dir: Path) -> None:
    """Download dataset NAME (mnist, cifar10, cifar100, tiny_imagenet, agnews) into DATA_DIR."""
    from .data import download as fetch_dataset

    try:
        folder = fetch_dataset(name, data_dir)
    except USER_ERRORS as exc:
        fail(exc)
    click.echo(f"{name}: ready in {folder} (use dataset={name} data_dir={folder})")


@main.command(epilog="""Examples:

\b
    pflkit sweep 'fedala.p=[1,2]' 'fedala.sample_fraction=[0.05,0.1]' 'algorithms=["fedala"]' --out results/sp
    pflkit sweep configs/mnist.toml data_dir=DIR 'alpha=[0.1,0.5]' --metric best_accuracy --out results/alpha
""")
@click.argument("args", nargs=-1)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="parent folder: one results folder per cell, named by its values")
@click.option("--metric", default="best_accuracy", show_default=True, help="summary metric of the table and plot")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: the cells one after another here; ray: each cell a Ray task (pip install 'pflkit[ray]')")
@click.option("--address", default=None, help="--executor ray: the Ray cluster (e.g. 10.0.0.1:6379 or auto); "
              "default: a Ray instance started on this machine. Results must be on storage every node shares")
@click.option("--cpus-per-cell", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="--executor ray: CPUs a cell reserves (match the config's run.threads x run.workers)")
@click.option("--gpus-per-cell", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="--executor ray: GPUs a cell reserves (1: a cell per GPU; set run.device=cuda)")
@click.option("--max-retries", type=click.IntRange(min=0), default=3, show_default=True,
              help="--executor ray: runs again of a cell whose worker died, each from its last checkpoint")
def sweep(args: tuple[str, ...], out: Path, metric: str, quiet: bool, executor: str, address: str | None,
          cpus_per_cell: float, gpus_per_cell: float, max_retries: int) -> None:
    """Run CONFIG (optional) over every combination of the KEY=[v1,v2,...] overrides; finished
    cells are skipped and an interrupted one resumes when the same command runs again."""
    from .federation import stop_on_signals
    from .run.sweep import run_sweep

    metric_words = ["--metric", metric] if metric != "best_accuracy" else []
    ray_options = {"--address": address, "--cpus-per-cell": cpus_per_cell != 1.0,
                   "--gpus-per-cell": gpus_per_cell != 0.0, "--max-retries": max_retries != 3}
    if executor == "local" and any(ray_options.values()):
        raise click.UsageError(f"{', '.join(k for k, v in ray_options.items() if v)} go(es) with --executor ray")
    if executor == "ray":
        metric_words += ["--executor", "ray", *(["--address", address] if address else []),
                         "--cpus-per-cell", f"{cpus_per_cell:g}", "--gpus-per-cell", f"{gpus_per_cell:g}",
                         "--max-retries", str(max_retries)]
    words = " ".join(shlex.quote(w) for w in ["pflkit", "sweep", *args, "--out", str(out), *metric_words])
    try:
        config, overrides = _split(args)
        with stop_on_signals():
            record = run_sweep(config, overrides, out, metric=metric, progress=not quiet, echo=click.echo,
                               executor=executor, address=address, cpus_per_cell=cpus_per_cell,
                               gpus_per_cell=gpus_per_cell, max_retries=max_retries)
    except KeyboardInterrupt as exc:
        interrupted(exc, f"the same command ({words}): finished cells are kept and the interrupted one resumes")
    except USER_ERRORS as exc:
        fail(exc)
    failed = [cell for cell in record["cells"] if "error" in cell]
    if failed:
        names = ", ".join(c["folder"] for c in failed)
        click.echo(f"error: {len(failed)} of {len(record['cells'])} cells failed ({names}); their errors are above, "
                   f"in {out / 'sweep.md'} and in each cell's run.json", err=True)
        sys.exit(1)


@main.command()
@click.argument("folders", nargs=-1, type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("report"), show_default=True,
              help="folder for NAME.md (figures beside it, in figures/) and the self-contained NAME.html")
@click.option("--name", default="report", show_default=True, help="file name of the report, without suffix")
@click.option("--title", default="pflkit report", show_default=True, help="the report's heading")
@click.option("--intro", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="a Markdown file whose text stands under the heading (the setting, what to read first)")
def report(folders: tuple[Path, ...], out: Path, name: str, title: str, intro: Path | None) -> None:
    """Collect results folders and sweep folders into one Markdown file and one HTML page: per
    method mean ± std of the summary metrics, the paper's numbers where the config names its
    table (paper_table), time to accuracy, cost per round and every figure. The command that made
    the report stands at its top."""
    from .run.report import build_report

    words = ["report", *map(str, folders), "--out", str(out)]
    words += ["--name", name] if name != "report" else []
    words += ["--title", title] if title != "pflkit report" else []
    words += ["--intro", str(intro)] if intro else []
    command = " ".join(["pflkit", *map(shlex.quote, words)])
    try:
        md, page = build_report(folders, out, name=name, title=title, command=command,
                                intro=intro.read_text() if intro else None)
    except USER_ERRORS as exc:
        fail(exc)
    click.echo(f"wrote {md} and {page}")


@main.group()
def plot() -> None:
    """Pictures of a finished run."""


@plot.command("ala")
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--seed", type=int, default=None, help="run seed (default: the first)")
@click.option("--client", type=int, default=None, help="also draw this client's start-phase loss per epoch")
def plot_ala_command(run: Path, seed: int | None, client: int | None) -> None:
    """ALA's learned weights per unit over rounds (mean, shares at 0 and 1), its loss, and with
    --client that client's weight-learning loss per epoch in the start phase (paper Fig. 3)."""
    from .federation import ResultsFolder
    from .reporting import plot_ala

    try:
        results = ResultsFolder(run)
        if not results.metrics_path.is_file():
            raise ValueError(f"{run} is not a results folder (no metrics.jsonl)")
        records = results.records()
        seeds = sorted({int(r["seed"]) for r in records})
        chosen = seed if seed is not None else (records[0]["seed"] if records else 0)
        if records and chosen not in seeds:
            raise ValueError(f"{run} holds no records of seed {chosen}; its seeds: {', '.join(map(str, seeds))}")
        if client is not None:
            clients = results.config_table().get("partition", {}).get("num_clients")
            if not isinstance(clients, int) or not 0 <= client < clients:
                raise ValueError(f"--client {client} is not a client of {run} (its clients: 0..{clients - 1})"
                                 if isinstance(clients, int) else f"{run}'s config names no client count")
        histories: dict[str, list] = {}
        for record in records:
            if record["seed"] == chosen:
                histories.setdefault(record["algorithm"], []).append(record)
        path = results.plots / "ala.png"
        if not plot_ala(histories, path, f"{run.name} (seed {chosen})", client):
            raise ValueError(f"{run} has no ALA method with recorded weights (fedala or X+ala)")
    except USER_ERRORS as exc:
        fail(exc)
    click.echo(f"wrote {path}")


@plot.command("trajectory")
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--client", type=int, required=True, help="a client listed in the run's trace.clients")
@click.option("--seed", type=int, default=None, help="run seed (default: the first)")
@click.option("--grid", type=click.IntRange(min=2), default=15, show_default=True,
              help="loss-surface lattice points per axis")
def plot_trajectory_command(run: Path, client: int, seed: int | None, grid: int) -> None:
    """A traced client's models over the rounds on their PCA plane, over its loss surface."""
    from .run.trajectory import trajectory_picture

    try:
        path = trajectory_picture(run, client, seed, grid)
    except USER_ERRORS as exc:
        fail(exc)
    click.echo(f"wrote {path}")


@plot.command("simplex")
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--algorithm", default="sosicfl", show_default=True, help="sosicfl, sosicfl_all or sosicfl_plus")
@click.option("--seed", type=int, default=None, help="run seed (default: the first)")
@click.option("--clients", default=None, help="comma-separated client ids (default: one per cluster, at most 3)")
@click.option("--points", type=click.IntRange(min=1), default=2000, show_default=True,
              help="uniform simplex points of the landscape")
def plot_simplex(run: Path, algorithm: str, seed: int | None, clients: str | None, points: int) -> None:
    """SosicFL's clients on the simplex (clusters, subregions) and their accuracy landscape."""
    from .run.simplex_report import simplex_pictures

    try:
        ids = [int(c) for c in clients.split(",")] if clients else None
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {clients!r}",
                                 param_hint="--clients") from None
    try:
        paths = simplex_pictures(run, algorithm, seed, ids, points)
    except USER_ERRORS as exc:
        fail(exc)
    for path in paths:
        click.echo(f"wrote {path}")


@main.command()
def algorithms() -> None:
    """List the algorithm names accepted in ``algorithms = [...]``."""
    from .methods import available

    for name in available():
        click.echo(name)


if __name__ == "__main__":
    main()

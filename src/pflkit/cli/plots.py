"""``pflkit plot``: pictures of a finished run."""

from __future__ import annotations

from pathlib import Path

import click

from .app import main
from .common import USER_ERRORS, fail


@main.group()
def plot() -> None:
    """Pictures of a finished run."""


@plot.command(
    "ala",
    epilog="\b\nExample:\n  pflkit run rounds=2 'algorithms=[\"fedala\"]' --out results/ala\n"
    "  pflkit plot ala results/ala --client 0",
)
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--seed", type=int, default=None, help="run seed (default: the first)")
@click.option("--client", type=int, default=None, help="also draw this client's start-phase loss per epoch")
def plot_ala_command(run: Path, seed: int | None, client: int | None) -> None:
    """ALA's learned weights per unit over rounds (mean, shares at 0 and 1), its loss, and with
    --client that client's weight-learning loss per epoch in the start phase (paper Fig. 3)."""
    from ..federation import ResultsFolder
    from ..reporting import plot_ala

    try:
        results = ResultsFolder(run)
        if not results.has(results.metrics_path.name):
            raise ValueError(f"{run} is not a results folder (no metrics.jsonl)")
        records = results.records()
        seeds = sorted({int(r["seed"]) for r in records})
        chosen = seed if seed is not None else (records[0]["seed"] if records else 0)
        if records and chosen not in seeds:
            raise ValueError(f"{run} holds no records of seed {chosen}; its seeds: {', '.join(map(str, seeds))}")
        if client is not None:
            clients = results.config_table().get("partition", {}).get("num_clients")
            if not isinstance(clients, int) or not 0 <= client < clients:
                raise ValueError(
                    f"--client {client} is not a client of {run} (its clients: 0..{clients - 1})"
                    if isinstance(clients, int)
                    else f"{run}'s config names no client count"
                )
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


@plot.command(
    "trajectory",
    epilog="\b\nExample:\n  pflkit run rounds=2 'algorithms=[\"fedala\"]' 'trace.clients=[0]' --out results/traced\n"
    "  pflkit plot trajectory results/traced --client 0",
)
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--client", type=int, required=True, help="a client listed in the run's trace.clients")
@click.option("--seed", type=int, default=None, help="run seed (default: the first)")
@click.option(
    "--grid", type=click.IntRange(min=2), default=15, show_default=True, help="loss-surface lattice points per axis"
)
def plot_trajectory_command(run: Path, client: int, seed: int | None, grid: int) -> None:
    """A traced client's models over the rounds on their PCA plane, over its loss surface."""
    from ..run.trajectory import trajectory_picture

    try:
        path = trajectory_picture(run, client, seed, grid)
    except USER_ERRORS as exc:
        fail(exc)
    click.echo(f"wrote {path}")


@plot.command(
    "simplex",
    epilog="\b\nExample:\n  pflkit run rounds=2 'algorithms=[\"sosicfl\"]' --out results/sosicfl\n"
    "  pflkit plot simplex results/sosicfl --points 500",
)
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--algorithm", default="sosicfl", show_default=True, help="sosicfl, sosicfl_all or sosicfl_plus")
@click.option("--seed", type=int, default=None, help="run seed (default: the first)")
@click.option("--clients", default=None, help="comma-separated client ids (default: one per cluster, at most 3)")
@click.option(
    "--points",
    type=click.IntRange(min=1),
    default=2000,
    show_default=True,
    help="uniform simplex points of the landscape",
)
def plot_simplex(run: Path, algorithm: str, seed: int | None, clients: str | None, points: int) -> None:
    """SosicFL's clients on the simplex (clusters, subregions) and their accuracy landscape."""
    from ..run.simplex_report import simplex_pictures

    try:
        ids = [int(c) for c in clients.split(",")] if clients else None
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers, got {clients!r}", param_hint="--clients"
        ) from None
    try:
        paths = simplex_pictures(run, algorithm, seed, ids, points)
    except USER_ERRORS as exc:
        fail(exc)
    for path in paths:
        click.echo(f"wrote {path}")

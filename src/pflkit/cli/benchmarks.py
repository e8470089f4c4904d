"""``pflkit bench`` and ``pflkit download``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..data.partition.spec import TestSet
from .app import main
from .common import USER_ERRORS, check_writable_file, fail


@main.command(
    epilog="""\b
Examples:
  pflkit bench --rounds 2                    # this machine's CPU, on an MNIST-shaped stand-in
  pflkit bench --device cuda --engines loop,vmap --clients 20,1000 --data-dir DIR
  pflkit bench --scale --out scale.json      # cost per client as the client count grows
"""
)
@click.option("--data-dir", default=None, help="MNIST folder (IDX files); default: an MNIST-shaped stand-in")
@click.option("--clients", default="20", show_default=True, help="comma-separated client counts")
@click.option(
    "--engines",
    default="loop,parallel",
    show_default=True,
    help="comma-separated engines: loop, parallel, vmap, vmap-graphs (CUDA only)",
)
@click.option("--algorithms", "algos", default="fedavg,fedala", show_default=True)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="rounds per engine (round 2 = ALA start phase)",
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=None, help="parallel engine workers (default: all cores)"
)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--test-set",
    type=click.Choice(["client_split", "official"]),
    default="client_split",
    show_default=True,
    help="official: also time the global model's evaluation on the official test set",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench.json"),
    show_default=True,
    help="JSON report",
)
@click.option(
    "--scale",
    is_flag=True,
    help="client-count scaling at a fixed total of samples: s/round, per-client "
    "overhead, peak memory and state bytes on disk per client count (defaults: --clients "
    "100,1000,10000 --engines parallel,vmap --rounds 3)",
)
@click.option(
    "--participants",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="--scale: clients trained per round at most (more clients: that many sampled)",
)
def bench(
    data_dir: str | None,
    clients: str,
    engines: str,
    algos: str,
    rounds: int,
    workers: int | None,
    device: str,
    test_set: TestSet,
    out: Path,
    scale: bool,
    participants: int,
) -> None:
    """Time FedAvg and FedALA rounds on each engine (MNIST CNN, Dir(0.1), batch 10, lr 0.1)."""
    from ..bench import BenchSettings, format_report, run_bench, save_report

    source = click.get_current_context().get_parameter_source
    default = click.core.ParameterSource.DEFAULT
    try:
        counts = [int(c) for c in clients.split(",")]
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers, got {clients!r}", param_hint="--clients"
        ) from None
    if min(counts) < 1:
        raise click.BadParameter(f"client counts must be at least 1, got {clients!r}", param_hint="--clients")
    try:  # before minutes of work: the device exists and the report can be written
        from ..federation.preparation import resolve_device

        resolve_device(device)
        check_writable_file(out)
    except USER_ERRORS as exc:
        fail(exc)
    from ..engines import ENGINES

    unknown = sorted(set(engines.split(",")) - set(ENGINES))
    if unknown:
        raise click.BadParameter(
            f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}", param_hint="--engines"
        )
    if scale:
        from ..bench_scale import ScaleSettings, format_scale_report, run_scale_bench

        given: dict[str, Any] = {"clients": counts, "engines": engines.split(","), "rounds": rounds}
        scale_settings = ScaleSettings(
            data_dir=data_dir,
            algorithms=algos.split(","),
            participants=participants,
            workers=workers,
            device=device,
            **{key: value for key, value in given.items() if source(key) != default},
        )
        run, show = (lambda: run_scale_bench(scale_settings, echo=click.echo)), format_scale_report
    else:
        if rounds < 2:
            raise click.BadParameter(
                f"needs at least 2 rounds (round 1 warms up, the median is over the later ones), got {rounds}",
                param_hint="--rounds",
            )
        settings = BenchSettings(
            data_dir=data_dir,
            clients=counts,
            engines=engines.split(","),
            algorithms=algos.split(","),
            rounds=rounds,
            workers=workers,
            device=device,
            test_set=test_set,
        )
        run, show = (lambda: run_bench(settings, echo=click.echo)), format_report
    try:
        report = run()
    except USER_ERRORS as exc:
        fail(exc)
    save_report(report, out)
    click.echo(show(report))
    click.echo(f"report: {out}")


@main.command(
    epilog="\b\nExample:\n  pflkit download mnist data/mnist\n"
    "  pflkit run configs/mnist_fedala.toml data_dir=data/mnist"
)
@click.argument("name")
@click.argument("data_dir", type=click.Path(file_okay=False, path_type=Path))
def download(name: str, data_dir: Path) -> None:
    """Download dataset NAME (mnist, fashion_mnist, emnist, svhn, usps, cinic10, cifar10, cifar100,
    tiny_imagenet, agnews, domainnet) into DATA_DIR."""
    from ..data import download as fetch_dataset

    try:
        folder = fetch_dataset(name, data_dir)
    except USER_ERRORS as exc:
        fail(exc)
    click.echo(f"{name}: ready in {folder} (use dataset={name} data_dir={folder})")

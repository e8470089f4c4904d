"""A sweep's cells as Ray tasks: on a Ray cluster (``--address``), or on a Ray instance started here.

Each cell is one task with the resources it asks for (``cpus``, ``gpus``); it runs
``run_experiment`` into its results folder, which must be on storage every node shares. A cell
whose worker dies (node lost, process killed) is run again by Ray, up to ``max_retries`` times,
and continues from the folder's last checkpoint (the kernel dropped the dead writer's lock); a
cell that fails by itself (a NaN loss) is not retried: its error comes back as its result, and
the other cells go on. Ray is imported here only, when a sweep asks for it (``pflkit[ray]``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..config import ConfigError, build_config
from ..federation.network import local_ray_access, prepare_ray, ray_keeps_signal_handlers
from ..federation.stopping import signal_handlers_kept
from .cell import run_cell

#: what a cell gets back: {"summary": ...} or {"error": ...}, with the attempts its folder saw
CellResult = dict[str, Any]


def cell_task(config: Mapping[str, Any], folder: str) -> CellResult:
    """What a Ray worker runs: the sweep cell of the resolved ``config`` into ``folder``."""
    try:
        built = build_config(dict(config), f"sweep cell {folder}")
    except ConfigError as exc:
        return {"error": f"ConfigError: {exc}"}
    return run_cell(built, Path(folder))


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--executor ray needs Ray: pip install -e '.[ray]' in a pflkit clone") from None
    return ray


def connect(address: str | None, cpus: float, gpus: float, init_args: Mapping[str, Any] = {}) -> tuple[Any, bool]:
    """Ray, connected to the cluster at ``address`` (None: a Ray instance started here, with
    ``init_args``), after checking that one of its nodes can hold a cell; and whether this call started it."""
    ray = _import_ray()
    prepare_ray(address)
    started = not ray.is_initialized()
    if started:
        try:
            with signal_handlers_kept():  # Ray's SIGTERM handler would exit without the stop's bookkeeping
                ray.init(
                    **{
                        "address": address,
                        "include_dashboard": False,
                        "logging_level": "ERROR",
                        "log_to_driver": False,
                        **init_args,
                    }
                )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = f"the Ray cluster at {address}" if address else "a local Ray instance"
            raise ConfigError(f"cannot connect to {where}: {str(exc).splitlines()[0]}") from None
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if not any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in nodes):
        have = ", ".join(f"{r.get('CPU', 0):g} CPU/{r.get('GPU', 0):g} GPU" for r in nodes) or "no live nodes"
        if started:
            ray.shutdown()
        raise ConfigError(
            f"no node of the Ray cluster has {cpus:g} CPU and {gpus:g} GPU for a cell "
            f"(--cpus-per-cell, --gpus-per-cell); its nodes: {have}"
        )
    return ray, started


@signal_handlers_kept()  # Ray installs a SIGTERM handler of its own that outlives ray.shutdown
def run_cells_on_ray(
    cells: Sequence[tuple[str, Mapping[str, Any], Path]],
    *,
    address: str | None = None,
    cpus: float = 1,
    gpus: float = 0,
    max_retries: int = 3,
    progress: bool = True,
    echo: Callable[[str], None] = print,
) -> dict[str, CellResult]:
    """Run ``cells`` ((name, resolved config, folder)) as Ray tasks; every cell's result by name.
    One line per finished cell, and a progress bar of cells done, unfinished (running or queued)
    and failed, with the elapsed time."""
    with ray_keeps_signal_handlers(), local_ray_access(address) as init_args:
        return _run_cells(cells, address, cpus, gpus, max_retries, progress, echo, init_args)


def _run_cells(
    cells: Sequence[tuple[str, Mapping[str, Any], Path]],
    address: str | None,
    cpus: float,
    gpus: float,
    max_retries: int,
    progress: bool,
    echo: Callable[[str], None],
    init_args: Mapping[str, Any],
) -> dict[str, CellResult]:
    ray, started = connect(address, cpus, gpus, init_args)
    try:
        task = ray.remote(num_cpus=cpus, num_gpus=gpus, max_retries=max_retries, retry_exceptions=False)(cell_task)
        pending = {task.remote(dict(config), str(folder.resolve())): name for name, config, folder in cells}
        results: dict[str, CellResult] = {}
        start = time.perf_counter()
        bar = tqdm(total=len(cells), desc="sweep (ray)", disable=not progress, dynamic_ncols=True)
        failed = 0
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)  # a stop is seen within a second
            for ref in done:
                name = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:  # an error run_cell does not turn into a result
                    cause = getattr(exc, "cause", None) or exc
                    result = {"error": f"{type(cause).__name__}: {cause}"}
                except ray.exceptions.RayError as exc:  # the worker died more often than max_retries
                    lines = str(exc).strip().splitlines()
                    result = {"error": f"{type(exc).__name__} after {max_retries} retries: {lines[0] if lines else ''}"}
                results[name] = result
                failed += "error" in result
                again = f", resumed after pid {result['resumed_from_pid']} died" if "resumed_from_pid" in result else ""
                outcome = f"failed: {result['error']}" if "error" in result else "done"
                echo(f"cell {name}: {outcome} ({time.perf_counter() - start:.0f} s{again})")
                bar.update(1)
            bar.set_postfix(unfinished=len(pending), failed=failed)  # done: the bar's count
        bar.close()
        return results
    finally:
        if started:
            ray.shutdown()

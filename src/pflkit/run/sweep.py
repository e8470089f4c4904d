"""``pflkit sweep``: a grid of runs over config keys, each a normal results folder under one
parent, resumable cell by cell, with a table and a plot of a summary metric against the values.

An override whose value is a list sweeps that key (``fedala.p=[1,2,3]``), except for keys that
take a list themselves (``algorithms``, ``seeds``), which a list of lists sweeps. A sweep file is
a config with a ``[sweep]`` table of such keys (``"fedala.p" = [1, 2]`` or ``[sweep.fedala]``); a key
given on the command line replaces the file's list for it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..config import (
    BaseConfig,
    ConfigError,
    ExperimentConfig,
    canonical_path,
    load_config,
    parse_override,
    read_toml,
    resolved,
    to_dict,
)
from ..data import NATURAL_DATASETS
from ..federation import ResultsFolder, build_partitions, folder_lock, partition_dataset, partition_seed
from ..federation.archive import PACKED_SWEEP_RECORD, SWEEP_RECORD
from ..federation.driver import Callback
from ..federation.preparation import load_pool
from ..federation.results import CONFIG_FILE, EXECUTION_KEYS, atomic_write_text, differences
from ..reporting import plot_sweep
from ..reporting.summary import round_seconds, summary_metrics
from .cell import run_cell
from .cluster import run_cells_on_ray
from .experiment import check_fits
from .next_steps import sweep_lines


@dataclass(frozen=True)
class Axis:
    key: str
    values: list[Any]


def _takes_a_list(path: list[str]) -> bool:
    model: Any = ExperimentConfig
    for part in path:
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return False  # an unknown key: load_config names it
        model = fields[part].annotation
    return typing.get_origin(model) is list or model is list


def _target(item: str) -> tuple[str, ...]:
    path, value = parse_override(item)
    return tuple(canonical_path(path, value))


def split_axes(overrides: Sequence[str]) -> tuple[list[str], list[Axis]]:
    """Fixed overrides and sweep axes (list values of scalar keys, list of lists for list keys);
    an axis keeps the key as written (``lr`` or ``train.lr``)."""
    fixed: list[str] = []
    axes: list[Axis] = []
    for item in overrides:
        path, value = parse_override(item)
        key = ".".join(path)
        listed = isinstance(value, list)
        target = canonical_path(path, value)
        sweeps = listed and (not _takes_a_list(target) or (value and all(isinstance(v, list) for v in value)))
        if not sweeps:
            fixed.append(item)
            continue
        if not value:
            raise ConfigError(f"sweep over {key}: the list of values is empty")
        twice = next((a.key for a in axes if canonical_path(a.key.split("."), value) == target), None)
        if twice is not None:
            raise ConfigError(f"sweep over {key} is given twice" + (f" (as {twice} and {key})" if twice != key else ""))
        axes.append(Axis(key, value))
    if not axes:
        raise ConfigError("pflkit sweep needs at least one key with a list of values, e.g. fedala.p=[1,2]")
    return fixed, axes


def _flatten(table: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``{"fedala": {"p": [1, 2]}}`` and ``{"fedala.p": [1, 2]}`` both give ("fedala.p", [1, 2])."""
    out = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


#: Longest folder name of a cell; longer ones are cut and end in a hash of the whole name.
MAX_CELL_NAME = 120


def cell_name(assignment: Sequence[tuple[str, Any]]) -> str:
    """A folder name from the cell's values: ``fedala.p=2,fedala.sample_fraction=0.1``; a list of one
    number or name is that value (``algorithms=fedavg,seeds=0``); cut to ``MAX_CELL_NAME``
    characters plus a hash of the whole when the values are long."""
    parts = []
    for key, value in assignment:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, int, float)):
            value = value[0]
        text = json.dumps(value, separators=(",", ":")) if isinstance(value, (list, dict)) else str(value)
        parts.append(f"{key}={text}".replace("/", "_").replace("\\", "_").replace(" ", "").replace("\0", ""))
    name = ",".join(parts)
    if len(name) > MAX_CELL_NAME:
        name = f"{name[: MAX_CELL_NAME - 9]}~{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


def plan_sweep(
    config_path: str | None, overrides: Sequence[str]
) -> tuple[list[str], list[Axis], list[tuple[list[tuple[str, Any]], BaseConfig]]]:
    """The fixed overrides, the axes and every cell's (values, config) of a sweep; every cell's
    config is checked here, before anything runs."""
    data = read_toml(config_path) if config_path is not None else {}
    listed = data.pop("sweep", {})  # a sweep file: a config with a [sweep] table of key = [values]
    if not isinstance(listed, dict):
        raise ConfigError(f"{config_path}: [sweep] must be a table of key = [values]")
    given = {_target(item) for item in overrides}  # the command line replaces the file's list of a key
    from_file = [item for item in (f"{k}={json.dumps(v)}" for k, v in _flatten(listed)) if _target(item) not in given]
    fixed, axes = split_axes([*from_file, *overrides])
    cells = []
    seen: dict[str, list[tuple[str, Any]]] = {}
    for values in itertools.product(*(a.values for a in axes)):
        assignment = [(a.key, v) for a, v in zip(axes, values)]
        items = [*fixed, *(f"{k}={json.dumps(v)}" for k, v in assignment)]
        try:
            config = load_config(config_path, items, data=data)
        except ConfigError as exc:
            raise ConfigError(f"sweep cell {cell_name(assignment)}: {exc}") from None
        resolved = json.dumps(to_dict(config), sort_keys=True)
        if resolved in seen:
            raise ConfigError(
                f"sweep cells {cell_name(seen[resolved])} and {cell_name(assignment)} are the same "
                "config (equal values such as 1 and 1.0 in one list): list each value once"
            )
        seen[resolved] = assignment
        cells.append((assignment, config))
    names = [cell_name(a) for a, _ in cells]
    if len(set(names)) < len(names):
        clash = next(n for n in names if names.count(n) > 1)
        raise ConfigError(
            f"two sweep cells get the folder name {clash!r} (values that differ only in '/' or "
            "spaces): write the values so that they differ otherwise"
        )
    return fixed, axes, cells


def check_cells(cells: Sequence[tuple[list[tuple[str, Any]], BaseConfig]]) -> None:
    """Before any cell runs: each cell's data, partition (its first seed) and model fit its
    algorithms (``fedala.p`` beyond the model's units fails here, not after other cells ran)."""
    device = torch.device("cpu")
    datasets: dict[tuple[Any, ...], Any] = {}
    for assignment, config in cells:
        try:
            if config.dataset in NATURAL_DATASETS:
                config, partitions = build_partitions(config, device)
                data = next(iter(partitions.values()))
            else:
                key = (config.dataset, config.data_dir, config.partition.test_set, config.data.emnist_split)
                if key not in datasets:
                    datasets[key] = load_pool(config)
                data = partition_dataset(config, datasets[key], partition_seed(config, config.seeds[0]), device)
            check_fits(config, data)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ConfigError(f"sweep cell {cell_name(assignment)}: {exc}") from None


def saved_differences(results: ResultsFolder, config: BaseConfig) -> list[str]:
    """The dotted keys in which the config saved in ``results`` (plain or packed) differs from
    ``config`` (a saved config that no longer loads: its error)."""
    try:
        saved = resolved(results.config_table(), results.where(CONFIG_FILE))
        return [k for k in differences(saved, to_dict(config)) if k not in EXECUTION_KEYS]
    except ValueError as exc:  # ConfigError too
        return [f"(its config.toml does not load: {str(exc).splitlines()[0]})"]


def finished_summary(results: ResultsFolder) -> dict[str, Any] | None:
    """The summary of a cell's finished run, or None: no run, an unfinished one, or damaged files
    (running the cell then names the damaged file in its error; the sweep goes on)."""
    try:
        if results.has_summary() and results.status().get("status") == "complete":
            return results.summary()
    except (OSError, ValueError, RuntimeError):
        pass
    return None


def check_metric(metric: str) -> None:
    """``--metric`` must name a number of the runs' summaries."""
    if metric not in summary_metrics():
        choices = ", ".join(sorted(summary_metrics()))
        raise ConfigError(f"--metric {metric!r} is not a summary metric; choose from {choices}")


def run_sweep(
    config_path: str | None,
    overrides: Sequence[str],
    parent: str | Path,
    *,
    metric: str = "best_accuracy",
    progress: bool = True,
    echo: Callable[[str], None] = print,
    callbacks: Sequence[Callback] = (),
    executor: str = "local",
    address: str | None = None,
    cpus_per_cell: float = 1,
    gpus_per_cell: float = 0,
    max_retries: int = 3,
) -> dict[str, Any]:
    """Run every cell of the grid under ``parent`` (complete cells are skipped, an interrupted or
    failed one resumes), then write ``sweep.json``, ``sweep.md`` and ``sweep.png`` (``metric``
    against the first axis, one line per algorithm and value of the other axes).

    Every cell is checked before the first runs. A cell that fails while running (a NaN loss) is
    recorded with its error and the sweep goes on; the returned record lists it under ``cells``
    with an ``error``. The parent folder is locked: a second sweep into it is refused.
    ``executor = "ray"`` runs the cells as Ray tasks (``run.cluster``) on the cluster at
    ``address`` (None: a Ray instance started here), each with ``cpus_per_cell`` CPUs and
    ``gpus_per_cell`` GPUs; a cell whose worker dies is retried ``max_retries`` times from its
    last checkpoint. ``callbacks`` watch the records of local runs only."""
    if executor not in ("local", "ray"):
        raise ConfigError(f"unknown sweep executor {executor!r}; choose local or ray")
    fixed, axes, cells = plan_sweep(config_path, overrides)
    check_metric(metric)
    check_cells(cells)
    parent = Path(parent)
    if ResultsFolder(parent).has("run.json"):
        raise ConfigError(
            f"{parent} is the results folder of a run (it holds run.json): a sweep writes its cells "
            "and tables into a folder of its own; choose another --out"
        )
    with folder_lock(parent, "sweep folder"):
        for assignment, config in cells:
            folder = parent / cell_name(assignment)
            saved = ResultsFolder(folder)
            changed = saved_differences(saved, config) if saved.has_config() else []
            if changed:
                raise ConfigError(
                    f"sweep cell {folder} was run with another config (it differs in "
                    f"{', '.join(changed[:5])}: the fixed overrides or the config file changed); choose "
                    "another --out or delete that folder"
                )
        summaries: list[dict[str, Any]] = [
            {"values": dict(assignment), "folder": cell_name(assignment)} for assignment, _ in cells
        ]
        todo = []
        for cell, (_, config) in zip(summaries, cells):
            summary = finished_summary(ResultsFolder(parent / cell["folder"]))
            if summary is not None:
                cell["summary"] = summary  # never rerun or overwritten
            else:
                todo.append((cell, config))
        if executor == "ray" and todo:
            outcomes = run_cells_on_ray(
                [(cell["folder"], to_dict(config), parent / cell["folder"]) for cell, config in todo],
                address=address,
                cpus=cpus_per_cell,
                gpus=gpus_per_cell,
                max_retries=max_retries,
                progress=progress,
                echo=echo,
            )
            for cell, _ in todo:
                outcome = outcomes[cell["folder"]]
                cell.update({k: outcome[k] for k in ("summary", "error") if k in outcome})
        elif todo:
            bar = tqdm(total=len(todo), desc="sweep", disable=not progress, dynamic_ncols=True)
            for cell, config in todo:
                outcome = run_cell(config, parent / cell["folder"], callbacks)
                cell.update({k: outcome[k] for k in ("summary", "error") if k in outcome})
                if "error" in outcome:
                    echo(f"sweep cell {cell['folder']} failed: {cell['error']}")
                bar.update(1)
            bar.close()
        table = sweep_table(axes, summaries, metric)
        record = {
            "config": config_path,
            "fixed": list(fixed),
            "axes": [{"key": a.key, "values": a.values} for a in axes],
            "metric": metric,
            "cells": summaries,
        }
        atomic_write_text(parent / SWEEP_RECORD, json.dumps(record, indent=2) + "\n")
        (parent / PACKED_SWEEP_RECORD).unlink(missing_ok=True)  # a packed record of an earlier sweep
        atomic_write_text(parent / "sweep.md", table + "\n")
        finished = [c for c in summaries if "summary" in c]
        if finished:
            plot_sweep(axes[0].key, [a.key for a in axes[1:]], finished, metric, parent / "sweep.png")
    echo(table)
    echo("\n".join(sweep_lines(parent, [config for _, config in cells])))
    return record


def sweep_table(axes: Sequence[Axis], cells: Sequence[dict[str, Any]], metric: str) -> str:
    """A Markdown table: one row per cell and algorithm, ``metric`` (mean ± std over seeds, in %
    for accuracies), seconds per round (every pass) and the local initialisation's (ALA's) part;
    a failed cell is one row with its error."""
    percent = "accuracy" in metric
    header = [*(a.key for a in axes), "algorithm", metric + (" %" if percent else ""), "s/round", "init s/round"]
    rows = []
    for cell in cells:
        values = [markdown_cell(cell["values"][a.key]) for a in axes]
        if "error" in cell:
            error = cell["error"].replace("|", "/").replace("\n", " ")
            rows.append([*values, "-", f"failed: {error[:160]}", "-", "-"])
            continue
        for algorithm, entry in cell["summary"].items():
            value = entry.get(metric)
            if value is None:
                shown = "-"
            else:
                scale = 100 if percent else 1
                shown = f"{scale * value:.2f}" + (
                    f" ± {scale * entry[metric + '_std']:.2f}" if entry.get("num_seeds", 1) > 1 else ""
                )
            rows.append(
                [
                    *values,
                    algorithm,
                    shown,
                    f"{round_seconds(entry):.3f}",
                    f"{entry.get('init_seconds_per_round', float('nan')):.3f}",
                ]
            )
    lines = ["| " + " | ".join(markdown_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def markdown_cell(value: Any) -> str:
    """``value`` as one Markdown table cell: a ``|`` escaped, line breaks as spaces."""
    return " ".join(str(value).splitlines()).replace("|", "\\|")

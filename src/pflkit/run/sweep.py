"""``pflkit sweep``: a grid of runs over config keys, each a normal results folder under one
parent, resumable cell by cell, with a table and a plot of a summary metric against the values.

An override whose value is a list sweeps that key (``fedala.p=[1,2,3]``), except for keys that
take a list themselves (``algorithms``, ``seeds``), which a list of lists sweeps. A sweep file is
a config with a ``[sweep]`` table of such keys (``"fedala.p" = [1, 2]`` or ``[sweep.fedala]``).
"""

from __future__ import annotations

import itertools
import json
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from ..config import BaseConfig, ConfigError, ExperimentConfig, load_config, parse_override, read_toml, to_dict
from ..federation import ResultsFolder
from ..federation.driver import Callback
from ..reporting import plot_sweep
from .experiment import run_experiment


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


def split_axes(overrides: Sequence[str]) -> tuple[list[str], list[Axis]]:
    """Fixed overrides and sweep axes (list values of scalar keys, list of lists for list keys)."""
    fixed, axes = [], []
    for item in overrides:
        path, value = parse_override(item)
        key = ".".join(path)
        listed = isinstance(value, list)
        sweeps = listed and (not _takes_a_list(path) or (value and all(isinstance(v, list) for v in value)))
        if not sweeps:
            fixed.append(item)
            continue
        if not value:
            raise ConfigError(f"sweep over {key}: the list of values is empty")
        if any(a.key == key for a in axes):
            raise ConfigError(f"sweep over {key} is given twice")
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


def cell_name(assignment: Sequence[tuple[str, Any]]) -> str:
    """A folder name from the cell's values: ``fedala.p=2,fedala.sample_fraction=0.1``."""
    parts = []
    for key, value in assignment:
        text = json.dumps(value, separators=(",", ":")) if isinstance(value, (list, dict)) else str(value)
        parts.append(f"{key}={text}".replace("/", "_").replace(" ", ""))
    return ",".join(parts)


def plan_sweep(config_path: str | None, overrides: Sequence[str]
               ) -> tuple[list[str], list[Axis], list[tuple[list[tuple[str, Any]], BaseConfig]]]:
    """The fixed overrides, the axes and every cell's (values, config) of a sweep; every cell's
    config is checked here, before anything runs."""
    data = read_toml(config_path) if config_path is not None else {}
    listed = data.pop("sweep", {})  # a sweep file: a config with a [sweep] table of key = [values]
    if not isinstance(listed, dict):
        raise ConfigError(f"{config_path}: [sweep] must be a table of key = [values]")
    from_file = [f"{k}={json.dumps(v)}" for k, v in _flatten(listed)]
    fixed, axes = split_axes([*from_file, *overrides])
    cells = []
    for values in itertools.product(*(a.values for a in axes)):
        assignment = [(a.key, v) for a, v in zip(axes, values)]
        items = [*fixed, *(f"{k}={json.dumps(v)}" for k, v in assignment)]
        cells.append((assignment, load_config(config_path, items, data=data)))
    return fixed, axes, cells


def run_sweep(config_path: str | None, overrides: Sequence[str], parent: str | Path, *, metric: str = "best_accuracy",
              progress: bool = True, echo: Callable[[str], None] = print,
              callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Run every cell of the grid under ``parent`` (complete cells are skipped, an interrupted one
    resumes), then write ``sweep.json``, ``sweep.md`` and ``sweep.png`` (``metric`` against the
    first axis, one line per algorithm and value of the other axes)."""
    fixed, axes, cells = plan_sweep(config_path, overrides)
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(cells), desc="sweep", disable=not progress, dynamic_ncols=True)
    summaries = []
    for assignment, config in cells:
        folder = parent / cell_name(assignment)
        results = ResultsFolder(folder)
        if results.config_path.is_file() and tomllib.loads(results.config_path.read_text()) != to_dict(config):
            raise ConfigError(f"sweep cell {folder} was run with another config (the fixed overrides or the config "
                              "file changed); choose another --out or delete that folder")
        if results.summary_path.is_file() and results.status().get("status") == "complete":
            summary = json.loads(results.summary_path.read_text())  # finished: never rerun or overwritten
        else:
            resume = results.config_path.is_file()
            summary = run_experiment(config, folder, resume=resume, progress=False, echo=lambda s: None,
                                     callbacks=callbacks)
        summaries.append({"values": dict(assignment), "folder": folder.name, "summary": summary})
        bar.update(1)
    bar.close()
    table = sweep_table(axes, summaries, metric)
    record = {"config": config_path, "fixed": list(fixed), "axes": [{"key": a.key, "values": a.values} for a in axes],
              "metric": metric, "cells": summaries}
    (parent / "sweep.json").write_text(json.dumps(record, indent=2) + "\n")
    (parent / "sweep.md").write_text(table + "\n")
    plot_sweep(axes[0].key, [a.key for a in axes[1:]], summaries, metric, parent / "sweep.png")
    echo(table)
    echo(f"sweep: {parent}")
    return record


def sweep_table(axes: Sequence[Axis], cells: Sequence[dict[str, Any]], metric: str) -> str:
    """A Markdown table: one row per cell and algorithm, ``metric`` (mean ± std over seeds, in %
    for accuracies) and the mean seconds per round."""
    percent = "accuracy" in metric
    header = [*(a.key for a in axes), "algorithm", metric + (" %" if percent else ""), "s/round"]
    rows = []
    for cell in cells:
        for algorithm, entry in cell["summary"].items():
            value = entry.get(metric)
            if value is None:
                shown = "-"
            else:
                scale = 100 if percent else 1
                shown = f"{scale * value:.2f}" + (f" ± {scale * entry[metric + '_std']:.2f}"
                                                  if entry.get("num_seeds", 1) > 1 else "")
            rows.append([*(str(cell["values"][a.key]) for a in axes), algorithm, shown,
                         f"{entry.get('mean_seconds_per_round', float('nan')):.3f}"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


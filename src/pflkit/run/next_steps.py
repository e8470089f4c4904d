"""What a finished run or sweep prints last: where its files are and the commands that come next."""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..config import BaseConfig
from ..methods import REGISTRY

REPORTS = Path("reports")


def _q(path: Path | str) -> str:
    return shlex.quote(str(path))


def _resolved(names: Iterable[str]) -> list[tuple[str, str, set[str]]]:
    """(name, base method, modifier suffixes) of each name the registry knows."""
    out = []
    for name in names:
        try:
            found = REGISTRY.resolve(name)
        except ValueError:
            continue
        out.append((name, found.base, {m.suffix for m in found.modifiers}))
    return out


def _report_line(folder: Path) -> str:
    return f"  pflkit report {_q(folder)} --out {_q(REPORTS / folder.name)}   # Markdown + HTML report"


def run_lines(root: Path, config: BaseConfig) -> list[str]:
    """The results folder, its plots and the commands that come next (report, the plots that fit
    the run's methods, TensorBoard when it is the tracker)."""
    plots = root / "plots"
    files = sorted(p.name for p in plots.glob("*.png")) if plots.is_dir() else []
    lines = [f"results: {root}", f"plots:   {plots}/ ({', '.join(files) or 'none yet'})", "next:", _report_line(root)]
    methods = _resolved(config.algorithms)
    if any("+ala" in modifiers for _, _, modifiers in methods):
        lines.append(f"  pflkit plot ala {_q(root)}   # ALA's learned weights over the rounds")
    if config.trace.clients:
        lines.append(
            f"  pflkit plot trajectory {_q(root)} --client {config.trace.clients[0]}   # a traced client's path"
        )
    simplex = [name for name, base, _ in methods if base.startswith("sosicfl")]
    if simplex:
        lines.append(f"  pflkit plot simplex {_q(root)} --algorithm {simplex[0]}   # clients on the simplex")
    if config.run.tracker == "tensorboard":
        lines.append(f"  tensorboard --logdir {_q(root / 'tensorboard')}")
    return lines


def sweep_lines(parent: Path, configs: Sequence[BaseConfig]) -> list[str]:
    """The sweep folder, its table and plot, and the commands that come next."""
    files = [name for name in ("sweep.md", "sweep.png") if (parent / name).is_file()]
    lines = [f"sweep:   {parent} ({', '.join(files)}; one results folder per cell)", "next:", _report_line(parent)]
    if any(c.run.tracker == "tensorboard" for c in configs):
        lines.append(f"  tensorboard --logdir {_q(parent)}   # every cell's runs")
    return lines

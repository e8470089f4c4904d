"""Figures: a method keeps its colour from one figure to the next, and round axes have whole-number
ticks."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex

from pflkit.methods import REGISTRY
from pflkit.reporting import plot_accuracy, plot_sweep
from pflkit.reporting.styles import ALIASES, METHODS, PALETTE, method_style


@pytest.fixture
def figures(monkeypatch) -> list:
    """The figures the plot functions draw, kept open (they close them after saving)."""
    kept: list = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    return kept


def _history(algorithms: list[str], rounds: int = 6) -> dict:
    return {
        (alg, 0): [{"round": r, "accuracy": 0.1 * (i + 1) + 0.01 * r} for r in range(rounds)]
        for i, alg in enumerate(algorithms)
    }


def _line_styles(fig) -> dict[str, tuple[str, str]]:
    (ax,) = fig.axes
    return {line.get_label(): (to_hex(line.get_color()), line.get_linestyle()) for line in ax.lines}


def test_a_method_keeps_its_colour_across_figures_and_ala_variants_are_its_dashed_kin(tmp_path: Path, figures) -> None:
    plot_accuracy(_history(["fedavg", "fedala", "ditto"]), tmp_path / "a.png")
    plot_accuracy(_history(["ditto", "fedprox", "fedavg", "mylab.methods:FedPer"]), tmp_path / "b.png")
    plot_accuracy(_history(["fedprox+ala", "ditto+ala"]), tmp_path / "c.png")
    a, b, c = (_line_styles(fig) for fig in figures)
    assert a["fedavg"] == b["fedavg"] and a["ditto"] == b["ditto"]
    assert a["fedala"] == (a["fedavg"][0], "--")  # fedala = fedavg+ala: FedAvg's colour, dashed
    assert c["fedprox+ala"] == (b["fedprox"][0], "--") and c["ditto+ala"] == (a["ditto"][0], "--")
    assert len({colour for colour, _ in b.values()}) == 4  # distinct within a figure
    outside = method_style("mylab.methods:FedPer")["color"]
    assert b["mylab.methods:FedPer"] == (outside, "-")
    assert outside not in {method_style(m)["color"] for m in METHODS}  # never mistaken for one of pflkit's


def test_round_axes_have_whole_number_ticks(tmp_path: Path, figures) -> None:
    plot_accuracy(_history(["fedavg"], rounds=3), tmp_path / "a.png")  # 3 rounds: matplotlib alone ticks 0.25s
    (ax,) = figures[0].axes
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks


def test_the_sweep_figure_draws_each_method_in_its_colour(tmp_path: Path, figures) -> None:
    cells = [
        {
            "values": {"fedala.p": p},
            "summary": {"fedala": {"best_accuracy": 0.5 + p / 10}, "ditto": {"best_accuracy": 0.4}},
        }
        for p in (1, 2)
    ]
    plot_sweep("fedala.p", [], cells, "best_accuracy", tmp_path / "s.png")
    (ax,) = figures[0].axes
    colours = {bars.get_label(): to_hex(bars.lines[0].get_color()) for bars in ax.containers}
    assert colours == {"fedala": method_style("fedala")["color"], "ditto": method_style("ditto")["color"]}


def test_the_colour_table_follows_the_registry() -> None:
    assert METHODS == tuple(REGISTRY.algorithms), "add the new method to reporting.styles.METHODS"
    assert {alias: target.split("+")[0] for alias, target in REGISTRY.aliases.items()} == ALIASES
    assert len(METHODS) <= len(PALETTE)  # every method of pflkit has a colour of its own

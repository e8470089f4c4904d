"""The digits feature-shift config end to end through the CLI, and the partition plot's domains."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from pflkit.cli import main
from tests.support.paths import REPO


@pytest.mark.integration
@pytest.mark.slow
def test_the_digits_feature_shift_config_runs_and_records_every_clients_domain(tmp_path) -> None:
    out = tmp_path / "run"
    config = str(REPO / "configs" / "feature-shift-digits.toml")
    result = CliRunner().invoke(main, ["run", config, "rounds=2", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "partition-seed0.json").read_text())
    domains = record["domains"]
    assert [d["rotation"] for d in domains] == [0.0] * 3 + [90.0] * 3 + [180.0] * 3 + [270.0] * 3
    assert [d["noise_std"] for d in domains] == pytest.approx([0.1 * i / 11 for i in range(12)])
    assert record["feature_shift"]["transforms"] == ["rotate", "noise"]
    summary = json.loads((out / "summary.json").read_text())
    assert {"fedavg", "fedala", "ditto", "local"} <= set(summary)
    assert (out / "plots" / "partition-seed0.png").stat().st_size > 0


def test_the_partition_plot_names_each_clients_domain(tmp_path, monkeypatch) -> None:
    from pflkit.reporting import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    counts = np.ones((3, 4), dtype=np.int64)
    plots.plot_partition(counts, tmp_path / "p.png", domains=["original", "rot 90", "rot 180"])
    (top,) = figures[0].axes[0].child_axes
    assert [t.get_text() for t in top.get_xticklabels()] == ["original", "rot 90", "rot 180"]
    plots.plot_partition(counts, tmp_path / "q.png")
    assert not figures[1].axes[0].child_axes

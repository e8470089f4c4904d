"""pflkit bench --scale: each client count in its own process, disk-stored client states."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pflkit.bench_scale import ScaleSettings, format_scale_report, run_scale_bench
from pflkit.cli import main


def test_scale_bench_reports_cost_memory_and_state_bytes(tmp_path) -> None:
    settings = ScaleSettings(clients=[4, 8], engines=["parallel"], algorithms=["fedala"], rounds=3, participants=4,
                             samples=800, measure_limits=False, state_dir=str(tmp_path))
    report = run_scale_bench(settings, echo=lambda s: None)
    small, large = report["cells"]
    assert (small["num_clients"], small["join_ratio"], large["join_ratio"]) == (4, 1.0, 0.5)
    assert small["samples_per_client"] == large["samples_per_client"] * 2  # one fixed total of samples
    run = large["runs"]["fedala/parallel"]
    assert run["participants"] == 4 and run["samples_per_round"] == 4 * large["samples_per_client"]
    # every trained client has exactly one state file after the round's checkpoint (older versions pruned)
    assert 4 <= run["state_files"] <= 8 and run["state_bytes_on_disk"] > run["state_files"] * 4 * 100_000
    assert small["runs"]["fedala/parallel"]["cost_per_sample_vs_first"] == pytest.approx(1.0)
    assert large["peak_rss_mb"] > 0 and "fedala/parallel" in format_scale_report(report)
    assert not list(tmp_path.iterdir())  # the temporary state folders are gone


def test_bench_rejects_unknown_engines() -> None:
    result = CliRunner().invoke(main, ["bench", "--scale", "--engines", "parallel,warp"])
    assert result.exit_code == 2 and "unknown engine(s) warp" in result.output

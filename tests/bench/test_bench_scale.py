"""pflkit bench --scale: each client count in its own process, disk-stored client states."""

from __future__ import annotations

import math
import statistics

import pytest
from click.testing import CliRunner

from pflkit.bench_scale import ScaleSettings, format_scale_report, run_scale_bench
from pflkit.cli import main


@pytest.mark.integration
@pytest.mark.slow
def test_scale_bench_reports_cost_memory_and_state_bytes(tmp_path) -> None:
    settings = ScaleSettings(
        clients=[4, 8],
        engines=["parallel", "loop"],
        algorithms=["fedala"],
        rounds=3,
        participants=4,
        samples=800,
        measure_limits=False,
        state_dir=str(tmp_path),
    )
    report = run_scale_bench(settings, echo=lambda s: None)
    assert [cell["num_clients"] for cell in report["cells"]] == settings.clients  # one cell per size, in order
    small, large = report["cells"]
    assert (small["join_ratio"], large["join_ratio"]) == (1.0, 0.5)
    assert small["samples_per_client"] == large["samples_per_client"] * 2  # one fixed total of samples
    assert small["train_samples"] == large["train_samples"] == 8 * large["samples_per_client"]
    keys = ["fedala/parallel", "fedala/loop"]
    for cell in report["cells"]:
        assert list(cell["runs"]) == keys
        assert math.isfinite(cell["peak_rss_mb"]) and cell["peak_rss_mb"] > 0
        assert math.isnan(cell["limit_batch10_before"]) and math.isnan(cell["limit_batch10_after"])
        for key, run in cell["runs"].items():
            ref = small["runs"][key]  # the same algorithm/engine in the first (smallest) cell
            seconds = run["round_seconds"]
            assert len(seconds) == settings.rounds and all(math.isfinite(t) and t > 0 for t in seconds)
            # fedala's steady state starts at round 3 (round 2 runs ALA's start phase)
            assert run["median_round_seconds"] == statistics.median(seconds[2:])
            assert run["participants"] == 4 and run["samples_per_round"] == 4 * cell["samples_per_client"]
            assert run["seconds_per_1k_samples"] == pytest.approx(
                1000 * run["median_round_seconds"] / run["samples_per_round"], rel=1e-12
            )
            # the cost ratios are against the first cell's run of the same key, recomputed from the timings
            assert run["cost_per_sample_vs_first"] == pytest.approx(
                run["seconds_per_1k_samples"] / ref["seconds_per_1k_samples"], rel=1e-12
            )
            expected = ref["median_round_seconds"] * run["samples_per_round"] / ref["samples_per_round"]
            assert run["per_client_overhead_ms"] == pytest.approx(
                1000 * (run["median_round_seconds"] - expected) / run["participants"], rel=1e-9, abs=1e-9
            )
            # no single-model rates were measured: the normalized figures are NaN, not made-up numbers
            assert math.isnan(run["normalized_round"]) and math.isnan(run["normalized_vs_first"])
            # every trained client has exactly one state file after the round's checkpoint (older versions
            # pruned): all 4 clients in the small cell; 4 to 8 (random halves over 3 rounds) in the large one
            low, high = (4, 4) if cell is small else (4, 8)
            assert low <= run["state_files"] <= high
            assert run["state_bytes_on_disk"] > run["state_files"] * 4 * 100_000
            assert run["cost_per_sample_vs_first"] > 0 and math.isfinite(run["cost_per_sample_vs_first"])
    # the large cell's ratio is a real quotient of two separately measured timings, not 1 by construction
    large_run, small_run = large["runs"]["fedala/parallel"], small["runs"]["fedala/parallel"]
    assert large_run["median_round_seconds"] != small_run["median_round_seconds"]
    assert large_run["cost_per_sample_vs_first"] != 1.0
    text = format_scale_report(report)
    assert all(f"{cell['num_clients']:>7} {key:<16}" in text for cell in report["cells"] for key in keys)
    assert f"{large_run['cost_per_sample_vs_first']:>8.2f}x" in text
    assert not list(tmp_path.iterdir())  # the temporary state folders are gone


def test_bench_rejects_unknown_engines() -> None:
    result = CliRunner().invoke(main, ["bench", "--scale", "--engines", "parallel,warp"])
    assert result.exit_code == 2 and "unknown engine(s) warp" in result.output


def test_bench_needs_two_rounds_for_its_median():
    result = CliRunner().invoke(main, ["bench", "--rounds", "1"])
    assert result.exit_code == 2 and "needs at least 2 rounds" in result.output


@pytest.mark.parametrize("final_pass", [False, True])
def test_bench_session_reaches_the_final_pass_only_when_asked(final_pass) -> None:
    """Every benchmark opens its run with bench_session: ``rounds`` steps are training rounds, and
    the final pass (evaluation without training) follows them only with ``final_pass``."""
    import torch

    from pflkit.algorithms import ClientSummary
    from pflkit.bench import BENCH_TRAIN, bench_model, bench_session, mnist_like
    from pflkit.data import PartitionSpec
    from pflkit.data.federated import FederatedData
    from pflkit.engines import RoundSetup, build_engine
    from pflkit.federation.session import on_engine

    data = FederatedData.build(mnist_like(600), PartitionSpec(method="label_dirichlet", num_clients=3, alpha=0.5), 1)
    model, init, alg = bench_model(data, "fedavg", 0, torch.device("cpu"))
    execute = on_engine(build_engine("loop"), RoundSetup(alg, data, model, model.units(), BENCH_TRAIN, 0))
    summaries = [ClientSummary(i, c.num_train, data.train_label_counts(i)) for i, c in enumerate(data.clients)]
    session = bench_session(alg, init, summaries, num_clients=3, rounds=2, final_pass=final_pass)
    for _ in range(2):
        plan = session.next_plan()
        assert plan is not None and plan.train  # a training round
        session.finish(plan, list(execute(plan.jobs, plan.round)))
    last = session.next_plan()
    if final_pass:
        assert last is not None and not last.train and last.round == 3  # the evaluation of round 2
    else:
        assert last is not None and last.train and last.round == 3  # never reached by the benchmark

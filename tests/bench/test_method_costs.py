"""benchmarks/method_costs.py: the costs file's arithmetic, and the committed files' numbers."""

from __future__ import annotations

import json
import statistics

import pytest

from pflkit.cli.leaderboard import COSTS
from tests.support.paths import REPO, load_script


def _script():  # type: ignore[no-untyped-def]
    return load_script("benchmarks/method_costs.py")


def test_costs_are_steady_medians_over_fedavgs_and_over_the_inherent_work(tmp_path) -> None:
    script = _script()
    runs = {
        "fedavg": [{"wall": 9.0}, {"wall": 10.0}, {"wall": 12.0}, {"wall": 11.0}],
        "ditto": [{"wall": 30.0}, {"wall": 36.0}, {"wall": 30.0}, {"wall": 33.0}],
    }
    late = script.report(runs, 4, 1, steady_from=3)  # rounds 3-4
    assert late["methods"]["fedavg"]["steady_seconds"] == 11.5
    assert late["methods"]["ditto"]["cost_vs_fedavg"] == pytest.approx(31.5 / 11.5)
    assert late["methods"]["ditto"]["cost_vs_inherent"] == pytest.approx(31.5 / 11.5 / 3.0)  # 3 epochs
    early = script.report(runs, 4, 1, steady_from=2)  # rounds 2-4
    assert early["methods"]["ditto"]["cost_vs_fedavg"] == pytest.approx(33.0 / 11.0)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(late))
    assert script.rescore(path, 2)["methods"]["ditto"]["cost_vs_fedavg"] == pytest.approx(33.0 / 11.0)
    with pytest.raises(SystemExit, match="no round from 5 on"):
        script.report(runs, 4, 1, steady_from=5)
    assert "model" not in late  # the setting's own model
    on_bn = script.report(runs, 4, 1, steady_from=3, model="fedavg_cnn_bn")
    assert on_bn["model"] == "fedavg_cnn_bn"
    path.write_text(json.dumps(on_bn))
    assert script.rescore(path, 2)["model"] == "fedavg_cnn_bn"  # a rescored file keeps its model


@pytest.mark.parametrize("name", [path.name for path in COSTS])
def test_a_committed_costs_file_is_what_its_round_times_give(name) -> None:
    committed = json.loads((REPO / "docs" / name).read_text())
    again = _script().rescore(REPO / "docs" / name, committed.get("steady_from", 3))
    for method, entry in committed["methods"].items():
        assert again["methods"][method]["cost_vs_fedavg"] == pytest.approx(entry["cost_vs_fedavg"], rel=1e-12)
        steady = entry["round_seconds"][committed.get("steady_from", 3) - 1 :]
        assert entry["steady_seconds"] == pytest.approx(statistics.median(steady), rel=1e-12)

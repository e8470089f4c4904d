"""pflkit leaderboard: one page of the committed result cells, and a method's rows for its page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.cli.leaderboard import COSTS
from pflkit.config import load_config, to_dict
from pflkit.federation import ResultsFolder
from pflkit.run.report.leaderboard import Ranking, leaderboard_markdown, method_results_markdown
from tests.support.paths import REPO

TABLE7 = [
    "name=fedala-table7-mnist",
    "paper_table=fedala-table7/mnist-dir0.1",
    "rounds=20",
    "plateau_evaluations=5",
    "partition=dirichlet",
    "alpha=0.1",
    "num_clients=20",
    "model=fedavg_cnn",
]
SOSICFL = [
    "name=sosicfl-mnist",
    "test_set=official",
    "rounds=20",
    "plateau_evaluations=5",
    "plateau_metric=global_accuracy",
]


def cell(
    folder: Path,
    overrides: list[str],
    method: str,
    seed: int,
    accuracy: list[float],
    *,
    stopped: bool = True,
    finished: bool = True,
    error: str | None = None,
    machine: str = "CPU box",
    **curves: list[float],
) -> None:
    """A results folder of one (method, seed) run whose rounds 0.. score ``accuracy`` (and ``curves``);
    ``error``: the run failed with it after its last round."""
    words = ["dataset=mnist", "data_dir=${PFLKIT_DATA}/mnist", f'algorithms=["{method}"]', f"seeds=[{seed}]"]
    results = ResultsFolder(folder / f"algorithms={method},seeds={seed}")
    results.create(to_dict(load_config(None, [*words, *overrides])))
    for r, value in enumerate(accuracy):
        record = {"algorithm": method, "seed": seed, "round": r, "accuracy": value, "std_client_accuracy": 0.0}
        record.update({key: curve[r] for key, curve in curves.items()})
        if finished and error is None and r == len(accuracy) - 1:
            record.update({"final_pass_seconds": 1.0, **({"stopped": "plateau"} if stopped else {})})
        results.append_record(record)
    if error is not None:
        results.set_status("failed", error=error, machine=machine)
    else:
        results.set_status("complete" if finished else "interrupted", machine=machine)


@pytest.fixture(scope="module")
def cells(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("leaderboard") / "results"
    table7 = root / "fedala-table7-mnist"
    cell(table7, TABLE7, "fedavg", 0, [0.5, 0.9, 0.97, 0.98, 0.98, 0.975])  # best 98 at round 3, stop at 5
    cell(table7, TABLE7, "fedavg", 1, [0.5, 0.9, 0.95, 0.96, 0.99, 0.98, 0.985])  # best 99 at round 4, stop at 6
    cell(table7, TABLE7, "fedala", 0, [0.5] * 20 + [0.995], stopped=False)  # to the cap (20 rounds)
    cell(table7, TABLE7, "fedprox+ala", 0, [0.5, 0.992, 0.99])
    cell(table7, TABLE7, "fedprox", 1, [0.5, 0.7], finished=False)
    cell(table7, [*TABLE7, "model=fedbn_cnn"], "fedbn", 0, [0.5, 0.95, 0.94])  # its own model, with batch norm
    cell(table7, TABLE7, "fedala", 1, [0.5, 0.6, 0.2], error="NonFiniteLossError: client 7's training loss is nan")
    cell(root / "fedala-table7-mnist-gpu", TABLE7, "ditto", 0, [0.5, 0.993, 0.99], machine="GPU box")
    rotated = root / "rotated-mnist"
    shift = [*TABLE7[2:], "name=rotated-mnist", "feature_shift.transforms=['rotate']"]
    cell(rotated, shift, "fedavg", 0, [0.5, 0.9, 0.93])
    cell(rotated, [*shift, "model=fedbn_cnn"], "fedbn", 0, [0.5, 0.96, 0.97], stopped=False)
    cell(root / "rotated-mnist-gpu", shift, "fedala", 0, [0.5, 0.9, 0.92], machine="GPU box")
    two_fold = root / "sosicfl-mnist-2fold"
    cell(two_fold, SOSICFL, "fedavg", 0, [0.5, 0.9], global_accuracy=[0.5, 0.91], local_accuracy=[0.5, 0.9])
    cell(two_fold, SOSICFL, "sosicfl", 0, [0.5, 0.95], global_accuracy=[0.5, 0.9], local_accuracy=[0.5, 0.95])
    costs = root.parent / "costs.json"
    methods = {"fedavg": {"cost_vs_fedavg": 1.0}, "fedala": {"cost_vs_fedavg": 1.176}}
    costs.write_text(json.dumps({"config": "setting.toml", "rounds": 3, "workers": 1, "methods": methods}))
    return root, costs


def table_rows(page: str, title: str) -> list[str]:
    section = page.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    body = section.split("|\n", 2)[2]  # below the header and its separator line
    return [line for line in body.splitlines() if line.startswith("| ")]


def test_table7_rows_are_sorted_means_with_population_std_rounds_costs_and_paper(cells) -> None:
    root, costs = cells
    page = leaderboard_markdown(root, costs)
    # the last column: PFLlib's FMNIST number and its place among the methods both tables hold
    assert table_rows(page, "FedALA Table 7: MNIST Dir(0.1), 20 clients") == [
        "| 1 | fedala | 99.50 | 1 (seed 1 failed) | 20 | 20 (1 of 1 at the cap) | 1.18 | 99.71 | 97.66 (1) |",
        "| 2 | ditto † | 99.30 | 1 | 1 | 2 | — | 99.64 | 97.47 (2) |",
        "| 3 | fedprox+ala | 99.20 | 1 | 1 | 2 | — | — | — |",
        # seeds 98 and 99: population std 0.50 (a sample std would be 0.71); best at rounds 3 and 4, stops 5 and 6
        "| 4 | fedavg | 98.50 ± 0.50 | 2 | 3.5 | 5.5 | 1.00 | 98.81 | 85.85 (3) |",
        "| 5 | fedbn ‡ | 95.00 | 1 | 1 | 2 | — | — | — |",
    ]
    assert "Kendall's tau-b = 1.00" in page and "Same place in both: fedala, ditto, fedavg." in page
    assert (
        "‡ fedbn: model fedbn_cnn; it keeps batch norm on each client and needs a model with it "
        "(the other rows: fedavg_cnn)." in page
    )
    assert "model fedavg_cnn" in page  # the table's setting is the common model's
    assert "† ditto: seed 0 from `fedala-table7-mnist-gpu/`, run on GPU box." in page
    assert "The other cells (`fedala-table7-mnist/`) ran on CPU box." in page
    assert "Not finished yet, not counted: fedprox seed 1 (round 1 so far, `fedala-table7-mnist/`)." in page
    # a failed run is a result: named with its error, not counted in its row's mean, not "unfinished"
    assert (
        "Failed, not counted in their rows: fedala seed 1 (`fedala-table7-mnist/`, last evaluated round 2): "
        "NonFiniteLossError: client 7's training loss is nan" in page
    )
    assert "`configs/paper/setting.toml`" in page and "pflkit sweep configs/reproduce/fedala-table7-mnist.toml" in page
    assert "FedACD" not in page  # a table without cells is left out


def test_a_published_ranking_on_another_dataset_is_compared_by_place_and_kendalls_tau() -> None:
    # a reversed order: tau -1; a tie in the published numbers shares the higher place
    reversed_order = Ranking(
        "PFLlib X", "a source", {"a": 99.0, "b": 98.0, "c": 97.0}, {"a": 90.0, "b": 91.0, "c": 92.0}
    )
    assert [reversed_order.shown(m) for m in "abcd"] == ["90.00 (3)", "91.00 (2)", "92.00 (1)", "—"]
    note = reversed_order.note()
    assert "Kendall's tau-b = -1.00" in note and "Same place in both: b." in note
    assert "Largest moves (here → there): a 1 → 3, c 3 → 1." in note
    tied = Ranking("PFLlib X", "a source", {"a": 99.0, "b": 98.0, "c": 97.0}, {"a": 97.25, "b": 97.25, "c": 90.0})
    assert [tied.shown(m) for m in "abc"] == ["97.25 (1)", "97.25 (1)", "90.00 (3)"]
    assert "tau-b = 0.82" in tied.note()  # one tied pair: tau-b, not tau-a (0.67)
    # a table with no method of the published one says so and computes nothing
    assert Ranking("PFLlib X", "a source", {}, {}).note().count("Kendall") == 0


def test_protocol_tables_are_compact_and_say_when_no_paper_number_exists(cells) -> None:
    root, costs = cells
    page = leaderboard_markdown(root, costs)
    section = page.split("## SosicFL's protocol: MNIST 2-Fold\n", 1)[1]
    assert "| method | best global acc % (mean ± std) | best local acc % (mean ± std) | seeds |" in section
    assert table_rows(page, "SosicFL's protocol: MNIST 2-Fold") == [
        "| fedavg | 91.00 | 90.00 | 1 |",
        "| sosicfl | 90.00 | 95.00 | 1 |",
    ]
    assert "No published number for this setting." in section


def test_the_rotated_mnist_table_marks_fedbn_with_its_own_model_and_names_both_folders(cells) -> None:
    root, costs = cells
    page = leaderboard_markdown(root, costs)
    title = "Rotated MNIST: Table 7's setting, each client's images rotated by 0, 90, 180 or 270°"
    assert table_rows(page, title) == ["| fedbn ‡ | 97.00 | 1 |", "| fedavg | 93.00 | 1 |", "| fedala † | 92.00 | 1 |"]
    section = page.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    assert "Cells in `rotated-mnist/` and `rotated-mnist-gpu/`," in section  # where the cells are, GPU folder too
    assert "‡ fedbn: model fedbn_cnn;" in section and "(the other rows: fedavg_cnn)" in section
    assert "model fedavg_cnn" in section and "No published number for this setting." in section


def test_a_methods_rows_across_the_tables(cells) -> None:
    root, _ = cells
    fedavg = method_results_markdown(root, "fedavg")
    assert fedavg is not None
    assert fedavg.splitlines()[2:] == [
        "| FedALA Table 7: MNIST Dir(0.1), 20 clients | best acc | 98.50 ± 0.50 | 2 | 4 of 5 | 98.81 |",
        "| Rotated MNIST: Table 7's setting, each client's images rotated by 0, 90, 180 or 270° | best acc | 93.00 "
        "| 1 | 2 of 3 | — |",
        "| SosicFL's protocol: MNIST 2-Fold | best global acc | 91.00 | 1 | 1 of 2 | — |",
        "| SosicFL's protocol: MNIST 2-Fold | best local acc | 90.00 | 1 | 2 of 2 | — |",
    ]
    ala = method_results_markdown(root, "fedprox+ala")
    assert ala is not None and "| 99.20 | 1 | 3 of 5 | — |" in ala
    assert method_results_markdown(root, "fedrep") is None  # no cell of it
    with pytest.raises(ValueError):
        method_results_markdown(root, "no-such-method")


def test_the_command_writes_the_page_and_rejects_a_folder_without_tables(cells, tmp_path) -> None:
    root, costs = cells
    out = tmp_path / "leaderboard.md"
    pages = tmp_path / "methods"
    args = [
        "leaderboard",
        "--results",
        str(root),
        "--costs",
        str(costs),
        "--out",
        str(out),
        "--methods-dir",
        str(pages),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert out.read_text() == leaderboard_markdown(root, costs)
    assert "## Results" in (pages / "fedala.md").read_text()
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, [*args[:2], str(tmp_path / "empty"), *args[3:]])
    assert result.exit_code == 2 and "holds none of the leaderboard's tables" in result.output


def test_cost_files_of_one_setting_merge_and_files_of_two_settings_are_refused(cells, tmp_path) -> None:
    root, costs = cells
    more = tmp_path / "more.json"
    methods = {
        "fedavg": {"cost_vs_fedavg": 1.0},
        "fedprox+ala": {"cost_vs_fedavg": 1.5},
        "fedala": {"cost_vs_fedavg": 9},
    }
    more.write_text(json.dumps({"config": "setting.toml", "rounds": 3, "workers": 1, "methods": methods}))
    rows = table_rows(leaderboard_markdown(root, [costs, more]), "FedALA Table 7: MNIST Dir(0.1), 20 clients")
    assert rows[0].endswith("| 1.18 | 99.71 | 97.66 (1) |")  # fedala: the first file's number
    assert rows[2] == "| 3 | fedprox+ala | 99.20 | 1 | 1 | 2 | 1.50 | — | — |"  # only in the second file
    more.write_text(json.dumps({"config": "other.toml", "rounds": 3, "workers": 1, "methods": methods}))
    with pytest.raises(ValueError, match="measured its costs in another setting"):
        leaderboard_markdown(root, [costs, more])


def test_a_cost_file_run_on_another_model_gives_its_methods_ratio_and_says_which_model(cells, tmp_path) -> None:
    root, costs = cells
    bn = tmp_path / "method-costs-fedbn.json"
    methods = {"fedavg": {"cost_vs_fedavg": 1.0}, "fedbn": {"cost_vs_fedavg": 1.04}}
    setting = {"config": "setting.toml", "rounds": 3, "workers": 1, "steady_from": 2}
    bn.write_text(json.dumps({**setting, "model": "fedbn_cnn", "methods": methods}))
    page = leaderboard_markdown(root, [costs, bn])
    rows = table_rows(page, "FedALA Table 7: MNIST Dir(0.1), 20 clients")
    assert next(r for r in rows if "| fedbn ‡ |" in r).split(" | ")[6] == "1.04"
    assert next(r for r in rows if "| fedavg |" in r).split(" | ")[6] == "1.00"  # the first file's FedAvg
    assert "The run of `method-costs-fedbn.json` put every method, FedAvg too, on model fedbn_cnn." in page
    assert "on model" not in leaderboard_markdown(root, costs).split("Round cost:")[1].split("\n")[0]


def test_the_committed_leaderboard_is_what_the_command_makes_from_the_committed_cells(tmp_path) -> None:
    out = tmp_path / "leaderboard.md"
    args = ["--results", str(REPO / "docs" / "results")]
    args += [arg for path in COSTS for arg in ("--costs", str(REPO / path))]  # the command's default files
    pages = tmp_path / "methods"
    result = CliRunner().invoke(main, ["leaderboard", *args, "--out", str(out), "--methods-dir", str(pages)])
    assert result.exit_code == 0, result.output
    hint = (
        "is not what the cells under docs/results/ and the methods' cards give (a cell added or changed, "
        "a card edited): run `pflkit leaderboard` at the repository root and commit docs/leaderboard.md "
        "and docs/reference/methods/"
    )
    assert out.read_text() == (REPO / "docs" / "leaderboard.md").read_text(), f"docs/leaderboard.md {hint}"
    committed = REPO / "docs" / "reference" / "methods"
    made = {p.name: p.read_text() for p in pages.glob("*.md")}
    assert made == {p.name: p.read_text() for p in committed.glob("*.md")}, f"docs/reference/methods/ {hint}"
    assert "## Results" in made["fedala.md"] and "99.68 ± 0.03" in made["fedala.md"]

"""pflkit report: runs and sweeps in one Markdown file and one self-contained HTML page."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.config import ConfigError, load_config
from pflkit.functional.training import NonFiniteLossError
from pflkit.reporting.paper import PAPER_TABLES
from pflkit.run.experiment import run_experiment
from pflkit.run.report import ala_gain_table, build_report, ranking_table
from tests.support.browser import find_browser, screenshot
from tests.support.paths import REPO


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "run"
    config = load_config(
        None,
        [
            "num_clients=5",
            "rounds=2",
            "seeds=[0,1]",
            'algorithms=["fedavg", "fedala"]',
            "paper_table=fedala-table2/mnist-pathological",
        ],
    )
    run_experiment(config, out, progress=False, echo=lambda s: None)
    return out


@pytest.mark.integration
def test_report_numbers_equal_the_summary_and_stand_beside_the_papers(run_folder, tmp_path) -> None:
    md, page = build_report([run_folder], tmp_path / "out")
    text = md.read_text()
    summary = json.loads((run_folder / "summary.json").read_text())
    for method, entry in summary.items():
        best = f"{100 * entry['best_accuracy']:.2f} ± {100 * entry['best_accuracy_std']:.2f}"
        assert f"| {method} | {best} |" in text
        paper = PAPER_TABLES["fedala-table2/mnist-pathological"]["values"][method][0]
        diff = f"{100 * entry['best_accuracy'] - paper:+.2f}"
        assert f"| {method} | best_accuracy | {best} | {paper:.2f} | {diff} |" in text
    assert "FedALA (AAAI 2023) Table 2, mnist-pathological" in text
    assert (tmp_path / "out" / "figures").is_dir() and "](figures/" in text
    html = page.read_text()
    assert "data:image/png;base64," in html and "<table>" in html and 'src="figures' not in html


def test_report_rejects_what_is_not_a_results_folder(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["report", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "is not a results folder (no config.toml)" in result.output
    # the name is checked where the tables live, before a run writes anything; the config checks its form
    with pytest.raises(ConfigError, match="paper_table = 'fedala-table9/x' is not a table pflkit ships"):
        run_experiment(
            load_config(None, ["paper_table=fedala-table9/x", "rounds=1", "num_clients=4"]),
            tmp_path / "never",
            progress=False,
            echo=lambda s: None,
        )
    assert not (tmp_path / "never").exists()
    with pytest.raises(ConfigError, match='paper_table: must be "<table>/<column>"'):
        load_config(None, ["paper_table=fedala-table9"])


@pytest.mark.integration
@pytest.mark.browser
def test_the_html_page_renders_in_headless_chromium(run_folder, tmp_path) -> None:
    """.ci/run installs Chromium and sets PFLKIT_REQUIRE_BROWSER=1, so there this test never skips."""
    browser = find_browser()
    _, page = build_report([run_folder], tmp_path / "out")
    shot = tmp_path / "shot.png"
    screenshot(browser, page.as_uri(), shot, 1200, 2000)
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2000, 1200)
    ink = pixels.min(axis=2) < 0.5  # dark pixels: text, table rules, plot lines
    rows = np.flatnonzero(ink.any(axis=1))
    assert ink.mean() > 0.005 and rows.size > 100  # a rendered page, not a blank or an error page
    colored = np.ptp(pixels, axis=2) > 0.3  # the embedded figures' coloured lines
    assert colored.sum() > 200, "no coloured figure pixels: the embedded plots did not render"


@pytest.mark.integration
def test_tensorboard_writes_one_run_per_method_and_seed_with_the_same_tags(tmp_path) -> None:
    """TensorBoard overlays runs, not tags: each (method, seed) is its own run (a folder under
    tensorboard/) whose tags are the record's fields, the same in every run."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = load_config(
        None, ["num_clients=4", "rounds=2", 'algorithms=["fedavg","fedala"]', "seeds=[0,1]", "tracker=tensorboard"]
    )
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    board = tmp_path / "run" / "tensorboard"
    runs = ["fedala-seed0", "fedala-seed1", "fedavg-seed0", "fedavg-seed1"]
    assert sorted(p.name for p in board.iterdir()) == runs
    assert not list(board.glob("events.*"))  # nothing written beside the runs
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for run in runs:
        algorithm, seed = run.rsplit("-seed", 1)
        events = EventAccumulator(str(board / run)).Reload()
        mine = [r for r in records if r["algorithm"] == algorithm and r["seed"] == int(seed)]
        scalars = events.Scalars("accuracy")
        assert [s.step for s in scalars] == [r["round"] for r in mine]
        assert [s.value for s in scalars] == pytest.approx([r["accuracy"] for r in mine])
        assert {"accuracy", "train_loss"} <= set(events.Tags()["scalars"])
        assert not any("/" in tag for tag in events.Tags()["scalars"])  # no per-run prefixes: the tags overlay


def test_sosicfl_cells_carry_table_5_beside_tables_2_and_3() -> None:
    cell = PAPER_TABLES["sosicfl-table3/cifar10-squeezenet-dir0.1"]
    assert cell["values"]["sosicfl"] == (54.63, 63.72) and cell["tta"]["sosicfl"] == (1.6, 2.9)
    assert "sosicfl_plus" not in PAPER_TABLES["sosicfl-table2/cifar10-simplecnn-2fold"]["tta"]  # not run on 2-Fold


@pytest.mark.integration
def test_cost_beside_the_papers_table_3_in_units_of_sigma(tmp_path) -> None:
    config = load_config(
        None,
        [
            "num_clients=5",
            "rounds=1",
            'algorithms=["fedavg", "fedrep", "fedfomo"]',
            "paper_table=fedala-table3/tiny-resnet18",
        ],
    )
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    text = build_report([tmp_path / "run"], tmp_path / "out")[0].read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if "Σ" in line and "|" in line}
    assert "| 2.00Σ | 2Σ |" in rows["fedavg"]
    assert "| 1.91Σ | 2α_fΣ |" in rows["fedrep"]  # the digits CNN's body is 13,056 of 13,706 values
    assert "| 5.00Σ | (1+M)Σ |" in rows["fedfomo"]  # 4 other models down, its own up (+ ids, weights)
    assert "**beside the paper" not in text  # Table 3 has no accuracies


def test_fedala_table_4_columns_and_ala_applicability_cells() -> None:
    assert PAPER_TABLES["fedala-table4/tiny-dir0.5"]["values"]["fedala"] == (27.85,)
    assert PAPER_TABLES["fedala-table4/cifar100-100clients"]["values"]["apple"] == (52.81,)
    ala = PAPER_TABLES["fedala-table4/ala-tiny"]["values"]
    # X + ALA beside X (its Table 2 TINY cell): the paper's "Imps." column is their difference
    assert ala["ditto+ala"] == (40.75,) and round(40.75 - ala["ditto"][0], 2) == 8.60
    assert (
        round(
            PAPER_TABLES["fedala-table4/ala-cifar100"]["values"]["fedphp+ala"][0]
            - PAPER_TABLES["fedala-table4/ala-cifar100"]["values"]["fedphp"][0],
            2,
        )
        == 3.76
    )


@pytest.mark.integration
def test_an_s_sweep_stands_beside_the_papers_table_1(tmp_path) -> None:
    from pflkit.run.sweep import run_sweep

    record = run_sweep(
        None,
        [
            "num_clients=4",
            "rounds=1",
            'algorithms=["fedala"]',
            "paper_table=fedala-table1/tiny-resnet18-s",
            "fedala.sample_fraction=[0.8,0.3]",
        ],
        tmp_path / "sweep",
        progress=False,
        echo=lambda s: None,
    )
    text = build_report([tmp_path / "sweep"], tmp_path / "out")[0].read_text()
    assert "beside the paper: FedALA (AAAI 2023) Table 1 (left)" in text
    ours = {c["values"]["fedala.sample_fraction"]: c["summary"]["fedala"]["best_accuracy"] for c in record["cells"]}
    assert f"| 0.8 | {100 * ours[0.8]:.2f} | 41.94 | {100 * ours[0.8] - 41.94:+.2f} |" in text
    assert f"| 0.3 | {100 * ours[0.3]:.2f} | - | - |" in text  # the paper did not run s = 30 %
    assert PAPER_TABLES["fedala-table6/tiny-cnn-p"]["sweep"]["values"] == {4: 39.75, 3: 39.89, 2: 39.94, 1: 40.54}
    assert "command: pflkit sweep num_clients=4 rounds=1 'algorithms=[\"fedala\"]' " in text
    assert "'fedala.sample_fraction=[0.8,0.3]' --metric best_accuracy --out sweep" in text
    (tmp_path / "intro.md").write_text("One round only.\n")
    result = CliRunner().invoke(
        main,
        [
            "report",
            str(tmp_path / "sweep"),
            "--out",
            str(tmp_path / "docs"),
            "--name",
            "results",
            "--title",
            "Results",
            "--intro",
            str(tmp_path / "intro.md"),
        ],
    )
    assert result.exit_code == 0, result.output
    md = (tmp_path / "docs" / "results.md").read_text()
    assert md.startswith("# Results\n") and f"pflkit report {tmp_path / 'sweep'} --out" in md
    assert "--intro" in md and "\nOne round only.\n" in md
    assert (tmp_path / "docs" / "results.html").is_file()


@pytest.mark.integration
def test_a_p_sweep_shows_alas_learnable_weights_beside_table_6s_param_row(tmp_path) -> None:
    """FedALA Table 6's "Param." row: ALA's element-wise weights per p, here counted from the run's
    model (the digits CNN on 8x8 digits: fc 64x10 + 10 = 650 for p = 1, + fc1 128x64 + 64 = 8,906 for p = 2)."""
    from pflkit.run.sweep import run_sweep

    run_sweep(
        None,
        [
            "num_clients=4",
            "rounds=1",
            'algorithms=["fedala"]',
            "paper_table=fedala-table6/tiny-cnn-p",
            "fedala.p=[1,2]",
        ],
        tmp_path / "sweep",
        progress=False,
        echo=lambda s: None,
    )
    summary = json.loads((tmp_path / "sweep" / "fedala.p=2" / "summary.json").read_text())
    assert summary["fedala"]["ala_weights"] == 64 * 10 + 10 + 128 * 64 + 64
    text = build_report([tmp_path / "sweep"], tmp_path / "out")[0].read_text()
    assert "| fedala.p | pflkit best_accuracy | paper | pflkit − paper | ALA weights | paper ALA weights |" in text
    lines = {
        line.split(" | ")[0].strip("| "): line
        for line in text.splitlines()
        if line.endswith("5,130 |") or line.endswith("529,930 |")
    }
    assert lines["1"].endswith("| 650 | 5,130 |") and lines["2"].endswith("| 8,906 | 529,930 |")


def test_partition_plot_of_thousands_of_clients_stays_small(tmp_path) -> None:
    from pflkit.reporting import plot_partition

    counts = np.random.default_rng(0).integers(0, 5, size=(5000, 10))
    plot_partition(counts, tmp_path / "p.png")
    assert 0 < (tmp_path / "p.png").stat().st_size < 500_000


@pytest.mark.integration
def test_an_unfinished_run_is_reported_over_its_finished_runs(tmp_path) -> None:
    from tests.support.runs import InterruptAfter

    config = load_config(None, ["num_clients=4", "rounds=2", 'algorithms=["fedavg", "fedala"]'])
    with pytest.raises(KeyboardInterrupt):  # fedavg finishes, fedala stops after its first round
        run_experiment(
            config, tmp_path / "run", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedala", 1)]
        )
    text = build_report([tmp_path / "run"], tmp_path / "out")[0].read_text()
    assert "**Unfinished run** (no summary.json yet)" in text and "seeds {'fedavg': [0]}" in text
    rows = [line for line in text.splitlines() if line.startswith("| fed")]
    assert rows and all(line.startswith("| fedavg |") for line in rows)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.toml").write_text((tmp_path / "run" / "config.toml").read_text())
    with pytest.raises(ValueError, match="none of its runs has finished yet"):
        build_report([tmp_path / "empty"], tmp_path / "out2")


@pytest.mark.integration
def test_cells_of_one_setting_make_one_table_with_seeds_rounds_and_the_paper(tmp_path) -> None:
    """docs/results/<table>/<cell>/: cells that differ only in methods and seeds are one table;
    an unfinished cell is listed with the round it reached; paper methods not run say so."""
    from tests.support.runs import InterruptAfter

    base = [
        "num_clients=4",
        "rounds=6",
        "plateau_evaluations=2",
        "plateau_points=100",
        "paper_table=fedala-table7/mnist-dir0.1",
    ]
    for method, seed in (("fedavg", 0), ("fedavg", 1), ("fedprox", 0)):
        config = load_config(None, [*base, f'algorithms=["{method}"]', f"seeds=[{seed}]"])
        run_experiment(
            config, tmp_path / "table" / f"algorithms={method},seeds={seed}", progress=False, echo=lambda s: None
        )
    from tests.support.runs import DivergeAfter

    # one run interrupted (not finished) and one diverging (failed: a NaN loss in its second round)
    for method, seed, stop, raised in (
        ("ditto", 0, InterruptAfter("ditto", 1), KeyboardInterrupt),
        ("fedala", 1, DivergeAfter(1), NonFiniteLossError),
    ):
        config = load_config(None, [*base, f'algorithms=["{method}"]', f"seeds=[{seed}]"])
        with pytest.raises(raised):
            run_experiment(
                config,
                tmp_path / "table" / f"algorithms={method},seeds={seed}",
                progress=False,
                echo=lambda s: None,
                callbacks=[stop],
            )
    text = build_report([tmp_path / "table"], tmp_path / "out")[0].read_text()
    assert "5 cells" in text and "at most 6 rounds" in text and "partition dirichlet (alpha 0.1)," in text
    # a failed run is a result of its own: named with its error, not "not finished" and not "not run"
    assert "**Failed**, not counted: algorithms=fedala,seeds=1 (fedala, seed 1: failed, reached round 0" in text
    assert "NonFiniteLossError: training loss became nan (algorithm fedala, round 2)" in text
    assert "fedala, seed 1" not in text.split("**Not finished**", 1)[1].split("\n", 1)[0]
    assert "**Not finished**: algorithms=ditto,seeds=0 (ditto, seed 0: " in text and "reached round" in text
    ditto = [
        json.loads(line)
        for line in (tmp_path / "table" / "algorithms=ditto,seeds=0" / "metrics.jsonl").read_text().splitlines()
    ]
    best = max((r for r in ditto if "accuracy" in r), key=lambda r: r["accuracy"])
    assert f"best so far {100 * best['accuracy']:.2f} at round {best['round']}, on " in text
    fedavg = next(line for line in text.splitlines() if line.startswith("| fedavg |"))
    cells = [c.strip() for c in fedavg.strip("|").split("|")]
    assert cells[1] == "0,1" and "±" in cells[2] and cells[4] == "3*,3*"  # stopped by the plateau rule at round 3
    assert cells[5] == "98.81" and cells[6].startswith(("+", "-"))
    assert "| fedala | - | failed (Failed, above) |" in text
    assert "| ditto | - | unfinished (Not finished, above) |" in text
    best = [
        json.loads((tmp_path / "table" / f"algorithms=fedavg,seeds={s}" / "summary.json").read_text())["fedavg"][
            "best_accuracy"
        ]
        for s in (0, 1)
    ]
    assert cells[2].startswith(f"{100 * np.mean(best):.2f} ± {100 * np.std(best):.2f}")
    assert "AMD" in text or "cores" in text  # the machine, from run.json
    assert "**ranks and gaps (points of best accuracy) beside the paper: over the 2 methods" in text
    assert "Kendall's tau between our best accuracies and the paper's is" in text
    shutil.copytree(tmp_path / "table" / "algorithms=fedprox,seeds=0", tmp_path / "one" / "algorithms=fedprox,seeds=0")
    text = build_report([tmp_path / "one"], tmp_path / "out1")[0].read_text()
    assert "(one): 1 cell\n" in text
    run_json = tmp_path / "table" / "algorithms=fedprox,seeds=0" / "run.json"
    status = json.loads(run_json.read_text())
    assert f"Machine: {status['machine']}. Wall time of the finished runs " in text
    run_json.write_text(json.dumps({**status, "machine": "Zeta CPU, 2 cores"}))  # a cell finished elsewhere
    text = build_report([tmp_path / "table"], tmp_path / "out3")[0].read_text()
    machines = "; ".join(sorted([status["machine"], "Zeta CPU, 2 cores"]))  # this machine's name may sort after
    assert f"Machines: {machines}. Wall time of the finished runs " in text


def test_ranks_and_gaps_beside_the_paper_and_what_ala_adds() -> None:
    """The ranking agreement counts the methods both have (Kendall's tau of their best
    accuracies) and which fall on the other side of FedAvg; X + ALA's gain needs both runs."""
    ours = {"fedavg": 0.98, "fedala": 0.996, "ditto": 0.997, "fedprox": 0.981, "fedprox+ala": 0.995, "local": 0.9}
    paper = {"fedavg": 98.81, "fedala": 99.71, "ditto": 99.64, "fedprox": 98.82}
    text, header, rows = ranking_table(ours, paper)
    # ours: ditto > fedala > fedprox > fedavg; the paper: fedala > ditto > fedprox > fedavg: 5 of 6 pairs agree
    assert "over the 4 methods" in text and "is 0.67" in text
    assert text.endswith("3 of 3 methods are on the same side of fedavg in both.")
    assert header == ["method", "pflkit rank", "paper rank", "pflkit − fedavg", "paper − fedavg"]
    assert rows[0] == ["ditto", "1", "2", "+1.70", "+0.83"] and rows[-1] == ["fedavg", "4", "4", "+0.00", "+0.00"]
    text, _, _ = ranking_table({**ours, "fedprox": 0.97}, paper)
    assert "2 of 3 methods are on the same side of fedavg in both (on the other side in one of them: fedprox)" in text
    assert ranking_table(ours, {"fedavg": 98.81}) is None
    without_base = ranking_table({"fedala": 0.99, "ditto": 0.98}, paper)
    assert without_base is not None and "side of" not in without_base[0] and len(without_base[1]) == 3
    assert "undefined" in ranking_table({"fedala": 0.99, "ditto": 0.99}, paper)[0]
    caption, header, rows = ala_gain_table(ours, {**paper, "fedprox+ala": 99.0})
    # FedAvg + ALA is FedALA, in our runs and in the paper's table
    assert rows == [
        ["fedavg", "fedala", "98.00", "99.60", "+1.60", "+0.90"],
        ["fedprox", "fedprox+ala", "98.10", "99.50", "+1.40", "+0.18"],
    ]
    assert ala_gain_table({"fedavg": 0.9, "ditto": 0.95, "fedala+ala": 0.96}, paper) is None


def test_the_committed_results_report_is_what_its_command_makes_from_the_committed_cells(tmp_path) -> None:
    """docs/results.md and .html hold no number that the committed cells do not give: the command
    at the top of docs/results.md, run again on docs/results/, writes the same files."""
    import shlex

    root = REPO
    committed = (root / "docs" / "results.md").read_text()
    command = committed.split("```bash\n", 1)[1].split("\n```", 1)[0]
    words = shlex.split(command)
    assert words[:2] == ["pflkit", "report"], command
    folders, options, rest = [], {}, iter(words[2:])
    for word in rest:
        if word.startswith("--"):
            options[word] = next(rest)
        else:
            folders.append(root / word)
    intro = (root / options["--intro"]).read_text() if "--intro" in options else None
    md, page = build_report(
        folders,
        tmp_path,
        name=options.get("--name", "report"),
        title=options.get("--title", "pflkit report"),
        command=command,
        intro=intro,
    )
    hint = (
        "docs/results.md is not what the command at its top makes from docs/results/ (a cell added or "
        "changed, the report's code or docs/results-intro.md changed, or a sweep is writing cells there now): "
        "rerun that command"
    )
    assert md.read_text() == committed, hint
    assert page.read_text() == (root / "docs" / "results.html").read_text(), hint


def test_a_method_section_splits_a_table_only_between_cells_that_run_it(tmp_path) -> None:
    """Every saved config lists every method's section: a key added to PartialFed later (its cells
    rerun, the others not) must not split the FedAvg cells from them; a PartialFed setting that
    differs between two PartialFed cells must."""
    from pflkit.run.report import one_setting

    def cell(name: str, method: str, partialfed: str):
        folder = tmp_path / name
        folder.mkdir(parents=True)
        (folder / "config.toml").write_text(
            f'name = "t"\nalgorithms = ["{method}"]\nseeds = [0]\nrounds = 5\n'
            f"[run]\nthreads = 1\n[partialfed]\n{partialfed}\n[fedala]\neta = 1.0\n"
        )
        return folder

    old = cell("a/fedavg", "fedavg", "tau0 = 5.0")
    new = cell("a/partialfed", "partialfed", 'tau0 = 5.0\nload = "round"')
    assert one_setting([old, new])
    assert not one_setting([new, cell("b/partialfed", "partialfed", 'tau0 = 5.0\nload = "batch"')])
    other_tau = cell("c/partialfed+ala", "partialfed+ala", 'tau0 = 4.0\nload = "round"')
    assert one_setting([old, other_tau]) and not one_setting([new, other_tau])
    ala = cell("d/fedala", "fedala", "tau0 = 1.0")
    assert one_setting([old, ala])
    (ala / "config.toml").write_text((ala / "config.toml").read_text().replace("eta = 1.0", "eta = 0.5"))
    assert not one_setting([ala, cell("e/fedrep+ala", "fedrep+ala", "tau0 = 5.0")])
    other = cell("f/fedavg", "fedavg", "tau0 = 5.0")
    (other / "config.toml").write_text((other / "config.toml").read_text().replace("rounds = 5", "rounds = 6"))
    assert not one_setting([old, other])  # a key outside the methods' sections always counts


def test_cells_run_with_other_workers_are_one_table(tmp_path) -> None:
    """A cell resumed with ``workers=1`` (two cells sharing a machine) computes what the others do:
    its saved ``[run] workers`` must not split the table; a computed [run] key still does."""
    from pflkit.run.report import one_setting

    def cell(name: str, run: str):
        return run_cell(tmp_path / name, name, run)

    plain, one_worker = cell("fedavg", ""), cell("sosicfl", "workers = 1\ncheckpoint_every = 5")
    assert one_setting([plain, one_worker])
    assert not one_setting([plain, cell("ditto", "workers = 1\neval_every = 5")])


def run_cell(folder: Path, method: str, run: str, top: str = "") -> Path:
    """A cell folder whose config.toml runs ``method`` for 5 rounds with ``run`` (lines after ``[run]``)
    and ``top`` (top-level lines)."""
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(
        f'name = "t"\nalgorithms = ["{method}"]\nseeds = [0]\nrounds = 5\n{top}\n[run]\nthreads = 1\n{run}\n'
    )
    return folder


def test_a_batch_norm_method_may_run_its_own_model_in_a_table_and_no_other_method_may() -> None:
    """FedBN needs a model with batch norm: its cells may run one (the same among them) beside cells
    of other methods on a model without; any other method on another model splits the table."""
    import tempfile

    from pflkit.run.report import one_setting
    from pflkit.run.report.folders import own_models

    root = Path(tempfile.mkdtemp())
    fedavg = run_cell(root / "a", "fedavg", "", 'model = "fedavg_cnn"')
    fedbn = run_cell(root / "b", "fedbn", "", 'model = "fedbn_cnn"')
    assert one_setting([fedavg, fedbn]) and one_setting([fedbn, fedavg])
    assert own_models([fedbn, fedavg]) == ("fedavg_cnn", {"fedbn": "fedbn_cnn"})
    assert not one_setting([fedavg, run_cell(root / "c", "fedprox", "", 'model = "fedbn_cnn"')])
    assert not one_setting([fedavg, fedbn, run_cell(root / "d", "fedbn", "", 'model = "resnet18"')])
    assert own_models([fedavg, run_cell(root / "e", "fedbn", "", 'model = "fedavg_cnn"')])[1] == {}
    assert own_models([fedbn]) == ("fedbn_cnn", {})  # a table of batch-norm cells alone marks nothing


def test_a_key_added_after_a_cell_ran_splits_no_table_at_its_default(tmp_path) -> None:
    """A cell saved before a key existed (here ``[run] unseen_clients`` and ``[feature_shift]``) is
    compared with its default filled in: one table with a newer cell that saved the default, two with
    one that set another value."""
    from pflkit.run.report import one_setting

    def cell(name: str, extra: str):
        return run_cell(tmp_path / name, "fedavg", extra)

    old = cell("old", "")
    assert one_setting([old, cell("new", "unseen_clients = 0\n[feature_shift]\ntransforms = []\n")])
    assert not one_setting([old, cell("other", "unseen_clients = 2\n")])


@pytest.mark.integration
def test_an_unfinished_cells_best_so_far_is_on_the_plateau_metric(tmp_path) -> None:
    """A table whose runs stop on the global accuracy (SosicFL's protocol) lists an unfinished cell's
    best global accuracy so far, named, not its local one."""
    config = load_config(
        None,
        [
            "num_clients=4",
            "rounds=6",
            'algorithms=["fedavg"]',
            "seeds=[0]",
            "plateau_evaluations=2",
            'plateau_metric="global_accuracy"',
            "test_set=official",
        ],
    )
    finished = tmp_path / "table" / "algorithms=fedavg,seeds=0"
    run_experiment(config, finished, progress=False, echo=lambda s: None)
    unfinished = tmp_path / "table" / "algorithms=sosicfl,seeds=0"
    unfinished.mkdir()
    (unfinished / "config.toml").write_text((finished / "config.toml").read_text().replace('"fedavg"', '"sosicfl"', 1))
    records = [
        {"algorithm": "sosicfl", "seed": 0, "round": 5, "accuracy": 0.97, "global_accuracy": 0.91},
        {"algorithm": "sosicfl", "seed": 0, "round": 10, "accuracy": 0.95, "global_accuracy": 0.93},
    ]
    (unfinished / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = build_report([tmp_path / "table"], tmp_path / "out")[0].read_text()
    assert "reached round 10, best global_accuracy so far 93.00 at round 10" in text


def test_time_to_accuracy_is_the_base_round_over_the_method_round_and_counts_ties_as_reached() -> None:
    """SosicFL's time to accuracy (paper, Section 4.1) by hand: the target is the base's best, the
    improvement the round the base first reaches it over the round the method does; a best equal up
    to summation noise is reached (two methods at 98.66 % each, summed over clients in another
    order, once read "not reached")."""
    from pflkit.reporting.summary import time_to_accuracy

    def history(values: list[float]) -> list[dict[str, float]]:
        return [{"round": 5 * (i + 1), "local_accuracy": v} for i, v in enumerate(values)]

    base = {
        0: history([0.90, 0.95, 0.9866000000000003]),
        1: history([0.90, 0.97, 0.98]),
        2: history([0.90, 0.99, 0.99]),
    }
    method = {
        0: history([0.9866000000000001, 0.97, 0.98]),
        1: history([0.90, 0.93, 0.98]),
        2: history([0.90, 0.95, 0.9898]),
    }
    histories = {**{("base", s): h for s, h in base.items()}, **{("method", s): h for s, h in method.items()}}
    out = time_to_accuracy(histories, {"method": "base"}, seeds=[0, 1, 2], metrics=("local_accuracy",))
    entry = out["method"]["tta_local_accuracy_vs_base"]
    per_seed = entry["seeds"]
    assert (per_seed["0"]["base_round"], per_seed["0"]["round"]) == (15, 5)  # the tie: x3
    assert (per_seed["1"]["base_round"], per_seed["1"]["round"]) == (15, 15)  # x1
    assert per_seed["2"]["round"] is None  # 98.98 % against 99 %: one sample in 10,000 short
    assert entry["reached_seeds"] == 2 and entry["improvement"] == pytest.approx((3.0 + 1.0) / 2)

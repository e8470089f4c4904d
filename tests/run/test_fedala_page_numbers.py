"""The FedALA page (docs/papers/fedala.md) quotes Table 7's rows: its comparison table must say what the
committed cells say (seeds that finished, mean and std of the best accuracies, the gap to the
paper), so that a new cell cannot leave the page's numbers behind."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from pflkit.federation import ResultsFolder
from tests.support.pages import table_rows
from tests.support.paths import REPO

PAGE = REPO / "docs" / "papers" / "fedala.md"
TABLE7 = REPO / "docs" / "results" / "fedala-table7-mnist"


def quoted_rows() -> list[list[str]]:
    """The cells of the first table under the Table 7 heading (header and rule skipped)."""
    return table_rows(PAGE.read_text(), "## Table 7: MNIST Dir(0.1), 20 clients", "\n| method | seeds |")


def method_id(name: str) -> tuple[str, tuple[str, ...]]:
    """'Per-FedAvg' -> ('perfedavg', table folders): a '(GPU)' row's cells are in the -gpu folder
    only; a row marked '†' has cells in both (the page's note says which seed ran where)."""
    method = re.sub(r"[^a-z]", "", name.replace("(GPU)", "").lower())
    if "(GPU)" in name:
        return method, (TABLE7.name + "-gpu",)
    return method, (TABLE7.name, TABLE7.name + "-gpu") if "†" in name else (TABLE7.name,)


def seeds_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def scored_records(cell) -> list[dict] | None:
    """The evaluated rounds' records of a finished cell (packed or not); None for a failed one."""
    folder = ResultsFolder(cell)
    if folder.status()["status"] != "complete":
        return None
    return [r for r in folder.records() if "accuracy" in r]


def best_accuracies(folder: str, method: str) -> dict[int, float]:
    """seed -> best accuracy (%) of the method's finished cells in a table folder."""
    out = {}
    for cell in sorted((REPO / "docs" / "results" / folder).glob(f"algorithms={method},seeds=*")):
        scored = scored_records(cell)
        if scored is not None:
            out[int(cell.name.rsplit("=", 1)[1])] = 100 * max(r["accuracy"] for r in scored)
    return out


def number(text: str) -> float:
    return float(text.replace("−", "-").replace("+", ""))


@pytest.mark.skipif(not TABLE7.exists(), reason="no committed Table 7 cells")
def test_the_fedala_pages_table7_rows_are_the_committed_cells() -> None:
    rows = quoted_rows()
    assert len(rows) >= 14, rows
    for name, seeds, ours, paper, gap in rows:
        method, folders = method_id(name)
        found: dict[int, float] = {}
        for folder in folders:
            cells = best_accuracies(folder, method)
            assert not set(cells) & set(found), f"{name}: a seed has a cell in more than one folder"
            found.update(cells)
        assert sorted(found) == seeds_of(seeds), f"{name}: the page says seeds {seeds}, finished cells {sorted(found)}"
        values = [found[s] for s in sorted(found)]
        mean = statistics.mean(values)
        quoted = ours.split(" (")[0]
        expected = f"{mean:.2f}" + (f" ± {statistics.pstdev(values):.2f}" if len(values) > 1 else "")
        assert quoted == expected, f"{name}: the page says {quoted}, the cells {expected}"
        if "(" in ours:  # the seeds' own numbers, in seed order
            listed = [float(v) for v in ours.split(" (")[1].rstrip(")").split(",")]
            assert listed == [round(v, 2) for v in values], f"{name}: per-seed {listed} against {values}"
        paper_value = number(paper.split(" ± ")[0])
        assert number(gap) == pytest.approx(round(mean - paper_value, 2), abs=1e-9), (
            f"{name}: gap {gap}, the cells' mean minus the paper's {paper_value} is {mean - paper_value:.3f}"
        )


@pytest.mark.skipif(not (TABLE7 / "algorithms=fedgh,seeds=1").exists(), reason="no committed FedGH seed-1 cell")
def test_fedghs_seed1_client_0_predicts_one_class_from_round_2_as_the_page_says() -> None:
    """The page's diagnosis of FedGH's seed 1: client 0's accuracy is one class's share of its test
    split in every round from 2 on, and the quoted numbers are those shares."""
    files = {name: data for name, (data, _) in ResultsFolder(TABLE7 / "algorithms=fedgh,seeds=1").archived().items()}
    partition = json.loads(files["partition-seed1.json"])
    counts = partition["test_class_counts"][0]
    shares = {round(c / sum(counts), 9): label for label, c in enumerate(counts)}
    records = [json.loads(line) for line in files["metrics.jsonl"].splitlines()]
    client0 = {r["round"]: r["client_accuracy"]["0"] for r in records if "client_accuracy" in r}
    assert round(client0[1], 9) not in shares
    assert all(round(a, 9) in shares for rnd, a in client0.items() if rnd >= 2)
    text = " ".join(PAGE.read_text().split())
    train = sum(partition["train_class_counts"][0])
    assert f"{100 * client0[1]:.2f} % at round 1" in text
    assert f"on any of the client's {train:,} training images" in text
    assert f"41.19 % is class {shares[round(client0[28], 9)]}'s" in text and f"{100 * client0[28]:.2f}" == "41.19"
    assert f"{100 * counts[1] / sum(counts):.2f} % class 1's" in text


LR001 = REPO / "docs" / "results" / "fedala-table7-mnist-lr0.01"


@pytest.mark.skipif(not LR001.exists(), reason="no committed lr-0.01 cells")
def test_the_lr001_rows_are_the_committed_cells() -> None:
    """'Table 7's setting at lr 0.01': each row's best accuracy, its round and the last round are its
    cell's, and every finished lr-0.01 cell has its row. The lr-0.1 column's best (and its round) and
    the round of its NaN are the Table 7 cell's of the same method and seed."""
    rows = table_rows(PAGE.read_text(), "### Table 7's setting at lr 0.01", "\n| method | seed |")
    quoted = {}
    for name, seed, best, at_lr01 in rows:
        found = re.fullmatch(r"([\d.]+) \((\d+)\), (\d+)", best)
        assert found, f"{name} seed {seed}: cannot read '{best}'"
        method = re.sub(r"[^a-z]", "", name.lower())
        quoted[(method, int(seed))] = found.groups()
        twin = ResultsFolder(TABLE7 / f"algorithms={method},seeds={seed}")
        scored = [r for r in twin.records() if "accuracy" in r]
        top = max(scored, key=lambda r: r["accuracy"])
        assert f"best {100 * top['accuracy']:.2f} at round {top['round']}" in at_lr01, (name, seed, at_lr01)
        nan = re.search(r"NaN (?:in fine-tuning )?in round (\d+)", at_lr01)
        error = twin.status().get("error", "")
        assert (nan is None) == (twin.status()["status"] == "complete"), (name, seed, at_lr01)
        assert nan is None or f"round {nan[1]}," in error, (name, seed, error)
    cells = {}
    for cell in sorted(LR001.glob("algorithms=*,seeds=*")):
        scored = scored_records(cell)
        if scored is None:
            continue
        top = max(scored, key=lambda r: r["accuracy"])  # the first round on a tie
        method, seed = cell.name.removeprefix("algorithms=").split(",seeds=")
        cells[(method, int(seed))] = (f"{100 * top['accuracy']:.2f}", str(top["round"]), str(scored[-1]["round"]))
    assert quoted == cells

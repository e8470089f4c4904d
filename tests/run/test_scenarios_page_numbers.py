"""The scenarios page (docs/scenarios.md) quotes the rotated-MNIST and unseen-client cells beside
their Table 7 twins: every number in its tables must be what the committed cells say, so that a new
cell cannot leave the page behind."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from pflkit.federation import ResultsFolder
from tests.support.pages import table_rows
from tests.support.paths import REPO, load_script

PAGE = REPO / "docs" / "scenarios.md"
RESULTS = REPO / "docs" / "results"
ROTATED = ("rotated-mnist", "rotated-mnist-gpu")
TABLE7 = ("fedala-table7-mnist", "fedala-table7-mnist-gpu")
UNSEEN = ("fedala-table7-unseen",)
ANGLES = {"0°": "original", "90°": "rot 90", "180°": "rot 180", "270°": "rot 270"}

pytestmark = pytest.mark.skipif(not (RESULTS / "rotated-mnist-gpu").exists(), reason="no committed rotated cells")


def table_after(marker: str, header: str) -> list[list[str]]:
    """The rows of the first table after ``marker`` on the page, whose header must be ``header``."""
    text = PAGE.read_text()
    section = text[text.index(marker) :]
    assert section[section.index("\n|") :].lstrip("\n").startswith(header + "\n"), f"{marker}: header changed"
    return table_rows(text, marker)


def finished(folders: tuple[str, ...]) -> set[tuple[str, int]]:
    """(method, seed) of every finished cell in the folders."""
    out = set()
    for folder in folders:
        for cell in (RESULTS / folder).glob("algorithms=*,seeds=*"):
            if ResultsFolder(cell).status()["status"] == "complete":
                method, seed = cell.name.removeprefix("algorithms=").split(",seeds=")
                out.add((method, int(seed)))
    return out


def method_id(name: str) -> str:
    return re.sub(r"[^a-z]", "", name.lower())


def seeds_of(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def number(text: str) -> float:
    return float(text.replace("−", "-").replace("+", ""))


def cells(folders: tuple[str, ...], method: str) -> dict[int, Path]:
    """seed -> the method's finished cell in any of the folders (a seed in two folders fails)."""
    out: dict[int, Path] = {}
    for folder in folders:
        for cell in sorted((RESULTS / folder).glob(f"algorithms={method},seeds=*")):
            if ResultsFolder(cell).status()["status"] != "complete":
                continue
            seed = int(cell.name.rsplit("=", 1)[1])
            assert seed not in out, f"{method} seed {seed} has cells in two folders"
            out[seed] = cell
    return out


def records(cell: Path) -> list[dict[str, Any]]:
    return [r for r in ResultsFolder(cell).records() if "accuracy" in r]


def best_accuracy(cell: Path) -> float:
    return 100 * max(r["accuracy"] for r in records(cell))


def assert_twin_failed(method: str, seed: int) -> None:
    """A rotated cell quoted without its twin: the Table 7 cell must exist and have failed."""
    twins = [RESULTS / folder / f"algorithms={method},seeds={seed}" for folder in TABLE7]
    states = [ResultsFolder(t).status()["status"] for t in twins if t.exists()]
    assert states == ["failed"], f"{method} seed {seed}: no twin quoted, but the Table 7 cells are {states}"


def test_the_rotated_rows_are_the_committed_cells_beside_their_table7_twins() -> None:
    rows = table_after("## Rotated MNIST", "| method | seeds | rotated | Table 7 | change |")
    quoted = [(method_id(row[0]), seed) for row in rows for seed in seeds_of(row[1])]
    assert len(quoted) == len(set(quoted)), "a cell quoted in two rows"
    assert set(quoted) == finished(ROTATED), "every finished rotated cell, and only those, in the table"
    for name, seeds, rotated, table7, change in rows:
        method = method_id(name)
        found = cells(ROTATED, method)
        twins = cells(TABLE7, method)
        row_seeds = seeds_of(seeds)
        rot = statistics.mean(best_accuracy(found[s]) for s in row_seeds)
        assert rotated == f"{rot:.2f}", f"{name} {seeds}: rotated {rotated}, cells {rot:.3f}"
        if table7 == "—":
            # a row without twins holds only seeds whose twin failed; paired seeds get a row of their own
            assert change == "—", f"{name} {seeds}: no Table 7 number, so no change"
            for seed in row_seeds:
                assert seed not in twins, f"{name} seed {seed} has a finished twin: quote it"
                assert_twin_failed(method, seed)
            continue
        t7 = statistics.mean(best_accuracy(twins[s]) for s in row_seeds)
        assert table7 == f"{t7:.2f}", f"{name} {seeds}: Table 7 {table7}, cells {t7:.3f}"
        assert number(change) == pytest.approx(round(rot - t7, 2), abs=1e-9), f"{name} {seeds}: change {change}"


def test_the_by_orientation_rows_are_the_committed_cells() -> None:
    script = load_script("benchmarks/domain_accuracy.py")
    text = PAGE.read_text()
    header = text[text.index("### By orientation") :]
    columns = [c.strip() for c in header[header.index("\n| method") :].strip().splitlines()[0].strip("|").split("|")]
    angles = columns[2:]
    assert angles == list(ANGLES), columns
    rows = table_after("### By orientation", "| method | seed | 0° | 90° | 180° | 270° |")
    assert {(method_id(row[0]), int(row[1])) for row in rows} == finished(ROTATED)
    for name, seed, *quoted in rows:
        method = method_id(name)
        rotated = cells(ROTATED, method)[int(seed)]
        found = script.accuracy_by_domain(rotated)["domains"]
        twin_cell = cells(TABLE7, method).get(int(seed))
        if twin_cell is None:
            assert_twin_failed(method, int(seed))
        twin = script.accuracy_by_domain(twin_cell, domains_of=rotated)["domains"] if twin_cell else {}
        for angle, value in zip(angles, quoted, strict=True):
            in_twin = f"{twin[ANGLES[angle]]:.2f}" if twin else "—"
            expected = f"{found[ANGLES[angle]]:.2f} ({in_twin})"
            assert value == expected, f"{name} seed {seed}, {angle}: the page says {value}, the cells {expected}"


def test_the_domain_groups_pool_to_the_runs_accuracy() -> None:
    # each group's accuracy is pooled by test-split size, so the groups pool back to the cell's accuracy
    script = load_script("benchmarks/domain_accuracy.py")
    cell = cells(ROTATED, "fedavg")[0]
    found = script.accuracy_by_domain(cell)
    partition = script.partition_of(ResultsFolder(cell))
    sizes = [sum(c) for c in partition["test_class_counts"]]
    labels = script.domain_labels(partition)
    by_group = {lab: sum(sizes[i] for i, x in enumerate(labels) if x == lab) for lab in found["domains"]}
    pooled = sum(found["domains"][lab] * n for lab, n in by_group.items()) / sum(by_group.values())
    assert pooled == pytest.approx(found["accuracy"], abs=1e-9)
    # the page's mapping: clients 0-4 unrotated, 5-9 by 90°, 10-14 by 180°, 15-19 by 270°
    assert labels == [label for label in ANGLES.values() for _ in range(5)]
    # an independent pooling of the unrotated clients, from the records and the partition
    best = max(records(cell), key=lambda r: r["accuracy"])
    by_hand = sum(best["client_accuracy"][str(i)] * sizes[i] for i in range(5)) / sum(sizes[:5])
    assert found["domains"]["original"] == pytest.approx(100 * by_hand, abs=1e-9)


def test_domain_accuracy_refuses_another_partition_and_unscored_clients() -> None:
    script = load_script("benchmarks/domain_accuracy.py")
    rotated = cells(ROTATED, "fedavg")[0]
    with pytest.raises(SystemExit, match="test class counts differ"):
        script.accuracy_by_domain(RESULTS / "fedacd-mnist-dir0.1" / "algorithms=fedavg,seeds=0", domains_of=rotated)
    with pytest.raises(SystemExit, match=r"clients \[16, 17, 18, 19\] are not scored"):
        script.accuracy_by_domain(cells(UNSEEN, "fedala")[0])


def test_the_unseen_rows_are_the_committed_cells() -> None:
    rows = table_after(
        "## Clients that never train",
        "| method | seed | participants, best | newcomers, same round | same 4 clients when they train (Table 7) |",
    )
    assert {(method_id(row[0]), int(row[1])) for row in rows} == finished(UNSEEN)
    for name, seed, participants, newcomers, trained in rows:
        method = method_id(name)
        cell = cells(UNSEEN, method)[int(seed)]
        best = max(records(cell), key=lambda r: r["accuracy"])
        assert participants == f"{100 * best['accuracy']:.2f}", f"{name}: participants {participants}"
        assert newcomers == f"{100 * best['unseen_accuracy']:.2f}", f"{name}: newcomers {newcomers}"
        unseen = [int(c) for c in best["unseen_client_accuracy"]]
        twin = cells(TABLE7, method)[int(seed)]
        twin_best = max(records(twin), key=lambda r: r["accuracy"])
        partition = load_script("benchmarks/domain_accuracy.py").partition_of(ResultsFolder(twin))
        sizes = [sum(c) for c in partition["test_class_counts"]]
        same = sum(twin_best["client_accuracy"][str(i)] * sizes[i] for i in unseen) / sum(sizes[i] for i in unseen)
        assert trained == f"{100 * same:.2f}", f"{name}: the same clients in Table 7 {trained}, cells {100 * same:.2f}"


def test_the_pfedme_newcomer_collapse_is_what_the_cells_say() -> None:
    """The page's reading of pFedMe's newcomers: client 17 scores exactly class 8's share of its
    test split at the rounds named, client 18 class 6's once, and the other methods' newcomers never
    fall that low."""
    cell = cells(UNSEEN, "pfedme")[0]
    counts = ResultsFolder(cell).partition(1)["test_class_counts"]
    rows = records(cell)

    def one_class(client: int) -> dict[int, int]:
        """round -> the class whose share of the client's test split is its accuracy there"""
        shares = {round(c / sum(counts[client]), 9): label for label, c in enumerate(counts[client])}
        found = {r["round"]: shares.get(round(r["unseen_client_accuracy"][str(client)], 9)) for r in rows}
        return {rnd: label for rnd, label in found.items() if label is not None}

    assert one_class(17) == dict.fromkeys([7, 24, 28, 32, 35, 36, 37], 8)
    assert one_class(18) == {33: 6}
    assert f"{100 * counts[17][8] / sum(counts[17]):.2f}" == "42.43" and (counts[17][8], sum(counts[17])) == (600, 1414)
    late = [100 * r["unseen_accuracy"] for r in rows if 26 <= r["round"] <= 37]
    assert (f"{min(late):.2f}", f"{max(late):.2f}", len(rows)) == ("80.09", "99.03", 38)
    top = max(rows, key=lambda r: r["unseen_accuracy"])
    assert (f"{100 * top['unseen_accuracy']:.2f}", top["round"]) == ("99.23", 16)
    lowest = {
        m: f"{100 * min(min(r['unseen_client_accuracy'].values()) for r in records(cells(UNSEEN, m)[0])):.2f}"
        for m in ("fedavg", "ditto", "fedala")
    }
    assert lowest == {"fedavg": "86.70", "ditto": "86.70", "fedala": "95.62"}
    text = " ".join(PAGE.read_text().split())
    for quoted in (
        "client 17 scores 42.43, exactly class 8's share of its test split (600 of 1,414 images)",
        "at 7 of the 38 evaluations (rounds 7, 24, 28, 32 and 35-37)",
        "exactly class 6's share once (round 33)",
        "between 80.09 and 99.03, and their best is 99.23 (round 16)",
        "never score under 86.70 on any client, FedALA's never under 95.62",
    ):
        assert quoted in text, quoted

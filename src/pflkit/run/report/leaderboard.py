"""``pflkit leaderboard``: one page of the committed result cells, a row per method and table:
FedALA's Table 7 on MNIST in detail (rounds to the plateau, round cost, the paper's number), FedACD's
and SosicFL's protocol tables compactly. Cells are read through ``ResultsFolder`` and the report's
folder helpers; per-method means and standard deviations are ``reporting.summarize``'s, as in
``pflkit report``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy.stats import kendalltau, rankdata

from ...config import BaseConfig
from ...federation import ResultsFolder
from ...methods import REGISTRY
from ...reporting import summarize
from ...reporting.paper import paper_cell
from .folders import cell_folders, needs_batch_norm, one_setting, own_models, run_status
from .render import pct
from .sections import partition_words

NONE = "—"
GPU_SUFFIX = "-gpu"  # a table's cells that ran on a GPU machine lie in <table>-gpu, beside its own folder


@dataclass(frozen=True)
class Board:
    """One table of the page: its folder under the results root, its title and its accuracy
    columns ``(name, summary key)``; the rows are sorted by the first. ``detailed``: rounds, cost
    and rank columns (FedALA's Table 7). ``ranked_against``: a published table of the same protocol
    on another dataset (a ``reporting.paper`` name), set beside the rows and compared by rank only."""

    folder: str
    title: str
    columns: tuple[tuple[str, str], ...]
    detailed: bool = False
    ranked_against: str | None = None


BEST = (("best acc %", "best_accuracy"),)
GLOBAL = (("best global acc %", "best_global_accuracy"),)
GLOBAL_LOCAL = (*GLOBAL, ("best local acc %", "best_local_accuracy"))
UNSEEN = (*BEST, ("best unseen acc %", "best_unseen_accuracy"), ("final unseen acc %", "final_unseen_accuracy"))
BOARDS = (
    Board(
        "fedala-table7-mnist",
        "FedALA Table 7: MNIST Dir(0.1), 20 clients",
        BEST,
        detailed=True,
        ranked_against="pfllib-benchmark/fmnist-dir0.1",
    ),
    Board("fedala-table7-mnist-lr0.01", "FedALA Table 7's setting at lr 0.01", BEST),
    Board("fedala-table7-unseen", "FedALA Table 7's setting, 4 of 20 clients never train", UNSEEN),
    Board(
        "rotated-mnist", "Rotated MNIST: Table 7's setting, each client's images rotated by 0, 90, 180 or 270°", BEST
    ),
    Board("fedacd-mnist-dir0.1", "FedACD's protocol: MNIST Dir(0.1)", GLOBAL),
    Board("fedacd-mnist-dir0.05", "FedACD's protocol: MNIST Dir(0.05)", GLOBAL),
    Board("sosicfl-mnist-2fold", "SosicFL's protocol: MNIST 2-Fold", GLOBAL_LOCAL),
    Board("sosicfl-mnist-5fold", "SosicFL's protocol: MNIST 5-Fold", GLOBAL_LOCAL),
    Board("sosicfl-mnist-dir0.5", "SosicFL's protocol: MNIST Dir(0.5)", GLOBAL_LOCAL),
)


@dataclass
class Row:
    """One method of a table: its summary over its finished seeds and where each seed ran."""

    method: str
    entry: dict[str, Any]
    seeds: list[int]
    stopped: list[bool]  # per seed: the plateau rule ended it (else it ran to the round cap)
    failed: list[int] = field(default_factory=list)  # seeds whose run failed (not counted)
    sources: dict[str, list[int]] = field(default_factory=dict)  # folder name -> seeds from there
    machines: dict[str, set[str]] = field(default_factory=dict)  # folder name -> machines of those seeds

    def value(self, key: str) -> float:
        found = self.entry.get(key)
        return -math.inf if found is None or math.isnan(found) else float(found)

    def shown(self, key: str) -> str:
        text = pct(self.entry, key, len(self.seeds) > 1)
        return NONE if text == "-" else text

    def per_seed(self, key: str) -> list[float]:
        return [float(self.entry["seeds"][str(s)][key]) for s in self.seeds]

    def seed_count(self) -> str:
        """How many seeds the row counts, and which failed beside them."""
        if not self.failed:
            return str(len(self.seeds))
        seeds = ", ".join(map(str, self.failed))
        return f"{len(self.seeds)} (seed{'s' if len(self.failed) > 1 else ''} {seeds} failed)"


@dataclass
class Table:
    """A board's rows (sorted), its config, the paper's cell, what did not finish yet and what
    failed (a run that stopped with an error, such as a NaN loss: a result, kept and named)."""

    board: Board
    config: BaseConfig
    rows: list[Row]
    paper: dict[str, Any] | None
    unfinished: list[str]
    failed: list[str] = field(default_factory=list)
    models: dict[str, str] = field(default_factory=dict)  # method -> the model it ran on, where not the table's
    folders: list[str] = field(default_factory=list)  # the folders under the results root that hold its cells

    def paper_value(self, method: str, key: str) -> float | None:
        if self.paper is None or key not in self.paper["metrics"] or method not in self.paper["values"]:
            return None
        return float(self.paper["values"][method][list(self.paper["metrics"]).index(key)])


def read_table(results_root: Path, board: Board) -> Table | None:
    """The board's table from ``<results_root>/<folder>`` and its ``-gpu`` sibling (a method's seeds
    from both make one row; a (method, seed) in both counts once, from the first); None where
    neither holds a cell."""
    folders = [results_root / board.folder, results_root / (board.folder + GPU_SUFFIX)]
    histories: dict[tuple[str, int], list[dict[str, Any]]] = {}
    where: dict[tuple[str, int], tuple[str, str]] = {}
    unfinished: dict[tuple[str, int], str] = {}  # runs without their final evaluation yet
    failed: dict[tuple[str, int], str] = {}  # runs that stopped with an error
    everywhere: list[Path] = []
    held: list[str] = []
    for folder in folders:
        cells = cell_folders(folder)
        if cells and not one_setting(cells):
            raise ValueError(f"{folder} holds cells of more than one setting: it cannot be one table")
        everywhere += cells
        held += [folder.name] if cells else []
        for cell in cells:
            results = ResultsFolder(cell)
            status = run_status(results)
            for key, history in results.histories().items():
                if key in histories:
                    continue
                if history and "final_pass_seconds" in history[-1]:
                    histories[key] = history
                    where[key] = (folder.name, str(status.get("machine") or status.get("host", "?")))
                elif status.get("status") == "failed":
                    reached = max((r["round"] for r in history), default=0)
                    where_failed = f"`{folder.name}/`, last evaluated round {reached}"
                    failed.setdefault(key, f"{key[0]} seed {key[1]} ({where_failed}): {status.get('error', '?')}")
                else:
                    reached = max((r["round"] for r in history), default=0)
                    unfinished.setdefault(key, f"{key[0]} seed {key[1]} (round {reached} so far, `{folder.name}/`)")
    if not everywhere:
        return None
    # the table's setting is that of its cells on the common model (a batch-norm method may run another)
    first = next(
        (c for c in everywhere if not needs_batch_norm(ResultsFolder(c).config_table().get("algorithms", []))),
        everywhere[0],
    )
    config = ResultsFolder(first).load_config()
    rows = []
    for method in sorted({m for m, _ in histories}):
        seeds = sorted(s for m, s in histories if m == method)
        row = Row(
            method,
            summarize(histories, [method], seeds)[method],
            seeds,
            [bool(histories[(method, s)][-1].get("stopped")) for s in seeds],
            failed=sorted(s for m, s in failed if m == method and (m, s) not in histories),
        )
        for seed in seeds:
            source, machine = where[(method, seed)]
            row.sources.setdefault(source, []).append(seed)
            row.machines.setdefault(source, set()).add(machine)
        rows.append(row)
    first_column = board.columns[0][1]
    rows.sort(key=lambda r: (-r.value(first_column), r.method))
    paper = paper_cell(config.paper_table) if config.paper_table else None
    return Table(
        board,
        config,
        rows,
        paper,
        sorted(v for k, v in unfinished.items() if k not in histories and k not in failed),
        sorted(v for k, v in failed.items() if k not in histories),
        own_models(everywhere)[1],
        held,
    )


def read_costs(*paths: Path) -> dict[str, Any]:
    """Method-costs files (``benchmarks/method_costs.py``'s JSON: its setting and, per method,
    ``cost_vs_fedavg`` against the FedAvg of the same run) as one, with a clear error where one is
    not such a file or the files were measured in different settings; a method in several files
    takes the first file's numbers."""
    merged: dict[str, Any] = {}
    for path in paths:
        try:
            costs = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a readable method-costs file ({exc})") from None
        if not isinstance(costs, dict) or not isinstance(costs.get("methods"), dict):
            raise ValueError(f'{path} is not a method-costs file: it has no "methods" table')
        setting = {k: costs.get(k) for k in ("config", "rounds", "workers")}
        if not merged:
            merged = {**setting, "methods": {}, "steady": {}, "models": {}}
        elif setting != {k: merged[k] for k in setting}:
            raise ValueError(
                f"{path} measured its costs in another setting ({setting}) than {paths[0]} "
                f"({ {k: merged[k] for k in setting} }): one leaderboard column cannot mix them"
            )
        merged["methods"] = {**costs["methods"], **merged["methods"]}
        merged["steady"][path.name] = int(costs.get("steady_from", 3))
        if costs.get("model"):  # a run of every method, FedAvg too, on another model than the config's
            merged["models"][path.name] = str(costs["model"])
    return merged


def _mean(values: Sequence[float]) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.0f}" if len(values) == 1 or mean == int(mean) else f"{mean:.1f}"


def _number(value: float | None) -> str:
    return NONE if value is None else f"{value:.2f}"


def _stop_rule(config: BaseConfig) -> str:
    run, rounds = config.run, config.train.rounds
    if not run.plateau_evaluations:
        return f"every run trains {rounds} rounds"
    return (
        f"a run stops at its plateau, once its best {run.plateau_metric.replace('_', ' ')} has not improved by "
        f"more than {run.plateau_points} points over its last {run.plateau_evaluations} evaluations "
        f"(at most {rounds} rounds)"
    )


def _setting(config: BaseConfig) -> str:
    return (
        f"Setting: {config.dataset}, {config.partition.num_clients} clients, partition "
        f"{partition_words(config.partition)}, model {config.model}, join ratio {config.run.join_ratio}"
    )


def _period(text: str) -> str:
    return text if text.endswith(".") else text + "."


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _model_notes(table: Table) -> list[str]:
    """One note per method that ran on another model than the table's (marked ‡)."""
    return [
        f"‡ {method}: model {model}; it keeps batch norm on each client and needs a model with it "
        f"(the other rows: {table.config.model})."
        for method, model in sorted(table.models.items())
    ]


def _name(row: Row, marked: set[str], table: Table) -> str:
    return row.method + (" †" if row.method in marked else "") + (" ‡" if row.method in table.models else "")


def _source_notes(table: Table) -> tuple[set[str], list[str]]:
    """The methods with seeds from the ``-gpu`` folder (marked †) and the notes saying where rows ran."""
    own = table.board.folder
    marked = {r.method for r in table.rows if any(source != own for source in r.sources)}
    notes = []
    for row in table.rows:
        for source, seeds in row.sources.items():
            if source != own:
                notes.append(
                    f"† {row.method}: seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} "
                    f"from `{source}/`, run on {'; '.join(sorted(row.machines[source]))}."
                )
    machines = sorted({m for r in table.rows for m in r.machines.get(own, ())})
    if machines and marked:
        notes.append(f"The other cells (`{own}/`) ran on {'; '.join(machines)}.")
    return marked, notes + _model_notes(table)


@dataclass
class Ranking:
    """A table's rows beside a published table of the same protocol on another dataset: the two
    orders of the methods both hold, compared by place (a tie shares the better place) and Kendall's
    tau-b, since the numbers of two datasets are not comparable."""

    label: str
    source: str
    ours: dict[str, float]  # method -> our first-column mean, for the methods in both
    theirs: dict[str, float]  # method -> the published number, for the same methods

    @classmethod
    def of(cls, table: Table, published: dict[str, Any]) -> Ranking:
        key = table.board.columns[0][1]
        values = {m: float(v[0]) for m, v in published["values"].items()}
        shared = [r for r in table.rows if r.method in values and math.isfinite(r.value(key))]
        return cls(
            str(published.get("label", "published")),
            str(published["source"]),
            {r.method: r.value(key) for r in shared},
            {r.method: values[r.method] for r in shared},
        )

    def ranks(self, values: dict[str, float]) -> dict[str, int]:
        methods = list(values)
        order = rankdata([-values[m] for m in methods], method="min")
        return {m: int(r) for m, r in zip(methods, order, strict=True)}

    def shown(self, method: str) -> str:
        if method not in self.theirs:
            return NONE
        return f"{self.theirs[method]:.2f} ({self.ranks(self.theirs)[method]})"

    def note(self) -> str:
        head = (
            f"{self.label}: {self.source}. The same protocol on another dataset, so compared by rank only: "
            f"(rank) is the method's place by that number among the {len(self.theirs)} methods both tables "
            f"hold (a tie shares the higher place); {NONE} where it has no row."
        )
        if len(self.theirs) < 2:
            return head
        ours, theirs = self.ranks(self.ours), self.ranks(self.theirs)
        methods = sorted(self.ours, key=lambda m: (ours[m], m))
        tau = kendalltau([ours[m] for m in methods], [theirs[m] for m in methods]).statistic
        agree = [m for m in methods if ours[m] == theirs[m]]
        moved = sorted(methods, key=lambda m: (-abs(ours[m] - theirs[m]), m))[:3]
        moved = [m for m in moved if ours[m] != theirs[m]]
        lines = [
            head,
            f"Over those methods, the two orders agree with Kendall's tau-b = {tau:.2f} (1: the same order; 0: "
            f"unrelated). Their places here: {', '.join(f'{m} ({ours[m]})' for m in methods)}.",
            f"Same place in both: {', '.join(agree) if agree else 'none'}."
            + (
                " Largest moves (here → there): " + ", ".join(f"{m} {ours[m]} → {theirs[m]}" for m in moved) + "."
                if moved
                else ""
            ),
        ]
        return " ".join(lines)


def _detailed(table: Table, costs: dict[str, Any]) -> list[str]:
    key = table.board.columns[0][1]
    marked, notes = _source_notes(table)
    header = ["#", "method", "best acc % (mean ± std)", "seeds", "best at round", "rounds to plateau"]
    header += ["round cost × FedAvg", "paper"]
    ranking = Ranking.of(table, paper_cell(table.board.ranked_against)) if table.board.ranked_against else None
    header += [f"{ranking.label} % (rank)"] if ranking else []
    rows = []
    for rank, row in enumerate(table.rows, 1):
        rounds = _mean([float(r) for r in row.per_seed("rounds")])
        capped = row.stopped.count(False)
        cost = costs["methods"].get(row.method, {}).get("cost_vs_fedavg")
        rows.append(
            [
                str(rank),
                _name(row, marked, table),
                row.shown(key),
                row.seed_count(),
                _mean(row.per_seed("best_round")),
                rounds + (f" ({capped} of {len(row.seeds)} at the cap)" if capped else ""),
                NONE if cost is None else f"{float(cost):.2f}",
                _number(table.paper_value(row.method, key)),
                *([ranking.shown(row.method)] if ranking else []),
            ]
        )
    last, workers = costs.get("rounds", 3), costs.get("workers", 1)

    def steady(first: int) -> str:
        return f"round {first}" if first == last else f"the median of rounds {first}-{last}"

    files = costs.get("steady") or {"": 3}
    where = "; ".join(f"{steady(first)}{f' in `{name}`' if len(files) > 1 else ''}" for name, first in files.items())
    notes.append(
        f"Round cost: the time of a method's steady training round ({where}; round 2 is ALA's start phase) "
        f"over FedAvg's in the same run of `benchmarks/method_costs.py --rounds {last} --workers {workers}`, in "
        f"this setting (`configs/paper/{costs.get('config', '?')}`) on one CPU machine, the methods advanced "
        f"round by round in turn so that drift hits them alike; {NONE} where that run did not measure the method."
        + "".join(
            f" The run of `{name}` put every method, FedAvg too, on model {model}."
            for name, model in (costs.get("models") or {}).items()
        )
    )
    if table.paper:
        notes.append(f"Paper: {table.paper['source']}, best accuracy %; {NONE} where it has no row.")
    if ranking:
        notes.append(ranking.note())
    return [*_markdown_table(header, rows), *_paragraphs(notes)]


def _paragraphs(notes: list[str]) -> list[str]:
    return [line for note in notes for line in ("", note)]


def _compact(table: Table) -> list[str]:
    marked, notes = _source_notes(table)
    columns = table.board.columns
    published = table.paper is not None
    header = ["method", *(f"{name} (mean ± std)" for name, _ in columns), "seeds"]
    header += [f"paper {name}" for name, _ in columns] if published else []
    rows = []
    for row in table.rows:
        cells = [_name(row, marked, table), *(row.shown(k) for _, k in columns)]
        cells.append(row.seed_count())
        cells += [_number(table.paper_value(row.method, k)) for _, k in columns] if published else []
        rows.append(cells)
    if not published:
        notes.append("No published number for this setting.")
    return [*_markdown_table(header, rows), *_paragraphs(notes)]


def _section(table: Table, costs: dict[str, Any]) -> list[str]:
    config, board = table.config, table.board
    lines = [f"## {board.title}", ""]
    if board.detailed:
        lines += [
            f"{_setting(config)}; every method X and, where it ran, X + ALA (`x+ala`; FedAvg + ALA is FedALA). "
            f'{_sentence(_stop_rule(config))}: "rounds to plateau" is the round it stopped at. '
            f"`PFLKIT_DATA=/path/to/datasets pflkit sweep configs/reproduce/{config.name}.toml --out "
            f"docs/results/{board.folder}` runs its cells (a sweep skips finished ones; the config's comments "
            f"add seeds). `pflkit leaderboard` at the repository root regenerates this page from the cells.",
            "",
        ]
        body = _detailed(table, costs)
    else:
        lines += [
            f"{_setting(config)}; {_stop_rule(config)}. Cells in {' and '.join(f'`{f}/`' for f in table.folders)}, "
            f"made by the sweep commands at the top of `configs/reproduce/{config.name}.toml`.",
            "",
        ]
        body = _compact(table)
    if table.failed:
        body += _paragraphs([_period("Failed, not counted in their rows: " + "; ".join(table.failed))])
    if table.unfinished:
        body += _paragraphs(["Not finished yet, not counted: " + "; ".join(table.unfinished) + "."])
    return lines + body + [""]


def read_tables(results_root: Path) -> list[Table]:
    """Every board that has cells under ``results_root`` (ValueError where there is none)."""
    if not results_root.is_dir():
        raise ValueError(
            f"{results_root} is not a folder of result cells (run at the repository root, or give --results)"
        )
    tables = [t for t in (read_table(results_root, b) for b in BOARDS) if t is not None]
    if not tables:
        raise ValueError(
            f"{results_root} holds none of the leaderboard's tables ({', '.join(b.folder for b in BOARDS)})"
        )
    return tables


def leaderboard_markdown(results_root: Path, costs_path: Path | Sequence[Path]) -> str:
    """The leaderboard page for the cells under ``results_root`` and the round costs of the
    method-costs file(s) ``costs_path``."""
    costs = read_costs(*([costs_path] if isinstance(costs_path, Path) else costs_path))
    lines = [
        "# pflkit leaderboard",
        "",
        "One row per method and table, from the result cells committed under `docs/results/` (one results "
        "folder per method and seed); `pflkit leaderboard` at the repository root rewrites this page from "
        "them. Accuracies are in %, each the best over a run's evaluated rounds, as the mean ± standard "
        "deviation over seeds (the population standard deviation, as in every pflkit summary); rows are "
        "sorted by the first accuracy column. Per-seed rounds, times and machines are in "
        "[results.md](results.md).",
        "",
    ]
    for table in read_tables(results_root):
        lines += _section(table, costs)
    return "\n".join(lines).rstrip("\n") + "\n"


def write_leaderboard(results_root: Path, out: Path, costs_path: Path | Sequence[Path]) -> Path:
    """Write the leaderboard page to ``out``."""
    text = leaderboard_markdown(results_root, costs_path)
    out.write_text(text)
    return out


def method_results_markdown(results_root: Path, method: str) -> str | None:
    """A Markdown table of ``method``'s rows across the leaderboard's tables (for its documentation
    page): per table and accuracy column its mean ± std, seeds, rank and the paper's number; None
    where it has no finished cell there. ValueError for a name pflkit does not know."""
    REGISTRY.resolve(method)
    rows = []
    for table in read_tables(results_root):
        found = next((r for r in table.rows if r.method == method), None)
        if found is None:
            continue
        for name, key in table.board.columns:
            ranked = sorted(table.rows, key=lambda r: (-r.value(key), r.method))
            rank = ranked.index(found) + 1
            rows.append(
                [
                    table.board.title,
                    name.removesuffix(" %"),
                    found.shown(key),
                    found.seed_count(),
                    f"{rank} of {len(ranked)}",
                    _number(table.paper_value(method, key)),
                ]
            )
    if not rows:
        return None
    return "\n".join(_markdown_table(["table", "metric", "pflkit %", "seeds", "rank", "paper %"], rows)) + "\n"

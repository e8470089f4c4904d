"""The sections of a report: one results folder (``run_section``), one sweep folder
(``sweep_section``) and the cells of one setting as one table (``table_section``)."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...data.partition.words import partition_words
from ...federation import ResultsFolder
from ...federation.packing import read_sweep_record
from ...federation.runner import tta_bases
from ...reporting import summarize
from ...reporting.paper import paper_cell
from ...reporting.summary import round_seconds, time_to_accuracy
from .comparison import ala_gain_table, cost_table, metrics_table, ranking_table, sweep_paper_table, tta_table
from .folders import finished_part, needs_batch_norm, own_models, run_status
from .render import Section, pct

#: Summary metrics of the main table (shown where a run recorded them), accuracies in %.
MAIN_COLUMNS = (
    ("best acc", "best_accuracy"),
    ("final acc", "final_accuracy"),
    ("best local acc", "best_local_accuracy"),
    ("best global acc", "best_global_accuracy"),
    ("best global client-dist acc", "best_global_client_accuracy"),
    ("best unseen acc", "best_unseen_accuracy"),
    ("final unseen acc", "final_unseen_accuracy"),
)

#: Columns a table of cells shows where its runs recorded them (best values; local risk: lowest).
TABLE_EXTRA_COLUMNS = (
    ("best global acc", "best_global_accuracy"),
    ("best global client-dist acc", "best_global_client_accuracy"),
    ("best local acc", "best_local_accuracy"),
    ("best local risk", "best_local_risk"),
    ("best unseen acc", "best_unseen_accuracy"),
)


def run_section(folder: Path) -> Section:
    """The section of one results folder: its setting, main table, paper comparison, time to
    accuracy and figures."""
    results = ResultsFolder(folder)
    if not results.has_config():
        raise ValueError(f"{folder} is not a results folder (no config.toml)")
    config = results.load_config()
    section = Section(f"{config.name} ({folder.name})")
    if results.has_summary():
        summary: dict[str, Any] = results.summary()
    else:
        summary = finished_part(results, config.train.rounds)
        seeds = {m: sorted(int(s) for s in e["seeds"]) for m, e in summary.items()}
        section.text.append(
            f"**Unfinished run** (no summary.json yet): numbers over the (method, seed) runs that "
            f"finished, seeds {seeds}."
        )
    multi = any(e.get("num_seeds", 1) > 1 for e in summary.values())
    section.text.append(
        f"{config.dataset}, model {config.model}, partition {config.partition.method}, "
        f"{config.partition.num_clients} clients, join ratio {config.run.join_ratio}, {config.train.rounds} rounds, "
        f"seeds {config.seeds}, test set {config.partition.test_set}; "
        f"metrics in %{' (mean ± std over seeds)' if multi else ''}."
    )
    columns = [(name, key) for name, key in MAIN_COLUMNS if any(key in e for e in summary.values())]
    header = [
        "method",
        *(n for n, _ in columns),
        "s/round",
        "init (ALA) s/round",
        "values down+up / client / round",
        "MB / round",
    ]
    rows = []
    for method, entry in summary.items():
        floats = entry.get("mean_down_floats_per_client", math.nan) + entry.get("mean_up_floats_per_client", math.nan)
        megabytes = (entry.get("mean_down_bytes", math.nan) + entry.get("mean_up_bytes", math.nan)) / 1e6
        rows.append(
            [
                method,
                *(pct(entry, key, multi) for _, key in columns),
                f"{round_seconds(entry):.3f}",
                f"{entry.get('init_seconds_per_round', math.nan):.3f}",
                "-" if math.isnan(floats) else f"{floats:,.0f}",
                "-" if math.isnan(megabytes) else f"{megabytes:.2f}",
            ]
        )
    section.tables.append(("results", header, rows))
    cell = paper_cell(config.paper_table) if config.paper_table else None
    if cell and cell.get("cost"):
        section.tables.append(cost_table(summary, cell))
    if cell and cell["metrics"]:
        section.tables.append(metrics_table(summary, cell, multi))
    tta = tta_table(summary, cell.get("tta", {}) if cell is not None else {})
    if tta:
        section.tables.append(tta)
    for png in sorted(results.plots.glob("*.png")):
        section.figures.append((png, png.stem.replace("_", " ")))
    return section


def portable(word: str) -> str:
    """An override as a report shows it: the dataset folder as ``DIR`` (never a path of the
    machine that made the report)."""
    key, _, _ = word.partition("=")
    return f"{key}=DIR" if key in ("data_dir", "pretrained") else word


def sweep_section(folder: Path) -> Section:
    """The section of one sweep folder: its command, failed cells, table and figure, and the
    paper's numbers for the swept metric where its cells' config names a paper table."""
    record = read_sweep_record(folder)
    fixed = [portable(w) for w in record["fixed"]]
    section = Section(f"sweep {folder.name}: {', '.join(a['key'] for a in record['axes'])}")
    section.text.append(
        f"config {record['config'] or '(defaults)'}, fixed {' '.join(fixed) or '-'}; "
        f"metric {record['metric']}" + ("; DIR: the dataset's folder." if fixed != record["fixed"] else ".")
    )
    axes = [f"{a['key']}={json.dumps(a['values'], separators=(',', ':'))}" for a in record["axes"]]
    words = [*([record["config"]] if record["config"] else []), *fixed, *axes]
    section.text.append(
        "command: pflkit sweep "
        + " ".join(shlex.quote(w) for w in words)
        + f" --metric {record['metric']} --out {shlex.quote(folder.name)}"
    )
    failed = [c for c in record["cells"] if "error" in c]
    if failed:
        section.text.append(
            f"**{len(failed)} cell(s) failed**: " + "; ".join(f"{c['folder']}: {c['error']}" for c in failed)
        )
    lines = (folder / "sweep.md").read_text().strip().splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    section.tables.append(("sweep", cells[0], cells[2:]))
    if (folder / "sweep.png").is_file():
        section.figures.append((folder / "sweep.png", f"{record['metric']} against {record['axes'][0]['key']}"))
    if record["cells"]:
        config = ResultsFolder(folder / record["cells"][0]["folder"]).load_config()
        if config.paper_table and paper_cell(config.paper_table).get("sweep"):
            section.tables.append(sweep_paper_table(record, paper_cell(config.paper_table)))
    return section


def table_section(folder: Path, cells: Sequence[Path]) -> Section:
    """One setting's cells (results folders that differ only in methods and seeds) as one table:
    per method the best accuracy (mean ± std over seeds), the round it was reached and the rounds
    run (the plateau rule or the cap), the paper's number and the difference, and the wall time;
    unfinished cells are listed with the round they reached, their best so far and the machine."""
    common = [c for c in cells if not needs_batch_norm(ResultsFolder(c).config_table().get("algorithms", []))]
    config = ResultsFolder((common or cells)[0]).load_config()
    histories: dict[tuple[str, int], list[dict[str, Any]]] = {}
    wall: dict[tuple[str, int], float] = {}
    machines: set[str] = set()
    unfinished = []
    failed = []  # runs that stopped with an error (a NaN loss): results, named with their error
    started: set[str] = set()  # methods with an unfinished run
    failed_methods: set[str] = set()
    for cell in cells:
        results = ResultsFolder(cell)
        status = run_status(results)
        runs = results.histories()
        done = {k: h for k, h in runs.items() if h and "final_pass_seconds" in h[-1]}
        histories.update(done)
        for key, history in done.items():
            wall[key] = sum(r.get("seconds", 0.0) for r in history) + history[-1]["final_pass_seconds"]
        if done:
            machines.add(str(status.get("machine") or status.get("host", "?")))
        for key in sorted(set(runs) - set(done)):
            judged = config.run.plateau_metric if any(config.run.plateau_metric in r for r in runs[key]) else "accuracy"
            scored = [r for r in runs[key] if judged in r]
            best = max(scored, key=lambda r: r[judged]) if scored else None
            so_far = (
                ""
                if best is None
                else (
                    f", best {'' if judged == 'accuracy' else judged + ' '}so far "
                    f"{100 * best[judged]:.2f} at round {best['round']}"
                )
            )
            machine = status.get("machine")
            state = status.get("status", "?")
            line = (
                f"{cell.name} ({key[0]}, seed {key[1]}: {state}, reached round "
                f"{max(r['round'] for r in runs[key])}{so_far}{f', on {machine}' if machine else ''})"
            )
            if state == "failed":
                failed_methods.add(key[0])
                failed.append(f"{line}: {status.get('error', '?')}")
            else:
                started.add(key[0])
                unfinished.append(line)
        if not runs:
            unfinished.append(f"{cell.name} ({status.get('status', '?')}, no round yet)")
    methods = list(dict.fromkeys(m for m, _ in histories))
    paper_entry = paper_cell(config.paper_table) if config.paper_table else None
    plateau = (
        f"a run stops once its best {config.run.plateau_metric} has not improved by more than "
        f"{config.run.plateau_points} points over its last {config.run.plateau_evaluations} evaluations, "
        f"at most {config.train.rounds} rounds"
        if config.run.plateau_evaluations
        else f"{config.train.rounds} rounds"
    )
    section = Section(f"{config.name} ({folder.name}): {len(cells)} cell{'s' if len(cells) != 1 else ''}")
    section.text.append(
        f"{config.dataset}, model {config.model}, partition {partition_words(config.partition)}, "
        f"{config.partition.num_clients} clients, join ratio {config.run.join_ratio}; {plateau}. Accuracies in % "
        f"(mean ± std over seeds where there are several). Each cell is `pflkit run {folder.name}/<cell>/config.toml` "
        "(its data_dir names the dataset's folder as ${PFLKIT_DATA}/...)."
    )
    total = sum(wall.values())
    section.text.append(
        f"Machine{'s' if len(machines) > 1 else ''}: {'; '.join(sorted(machines)) or '-'}. "
        f"Wall time of the finished runs {total / 3600:.2f} h."
    )
    for method, model in sorted(own_models(cells)[1].items()):
        section.text.append(
            f"{method} runs on model {model}: it keeps batch norm on each client and needs a model with it."
        )
    if failed:
        text = "**Failed**, not counted: " + "; ".join(failed)
        section.text.append(text if text.endswith(".") else text + ".")
    if unfinished:
        section.text.append("**Not finished**: " + "; ".join(unfinished) + ".")
    entries = {m: summarize(histories, [m], sorted(s for n, s in histories if n == m))[m] for m in methods}
    extra = [(name, key) for name, key in TABLE_EXTRA_COLUMNS if any(key in e for e in entries.values())]
    header = [
        "method",
        "seeds",
        "best acc",
        *(n for n, _ in extra),
        "best acc at round",
        "rounds run",
        "paper",
        "pflkit − paper",
        "s/round",
        "wall min (all seeds)",
    ]
    rows = []
    for method, entry in entries.items():
        seeds = sorted(s for m, s in histories if m == method)
        per_seed = [entry["seeds"][str(s)] for s in seeds]
        ran = [
            f"{m['rounds']}{'*' if histories[(method, s)][-1].get('stopped') else ''}" for m, s in zip(per_seed, seeds)
        ]
        published = (paper_entry or {}).get("values", {}).get(method)
        paper = published[0] if published else None
        ours = entry.get("best_accuracy")
        multi = len(seeds) > 1
        rows.append(
            [
                method,
                ",".join(map(str, seeds)),
                pct(entry, "best_accuracy", multi),
                *(pct(entry, key, multi) for _, key in extra),
                ",".join(str(m["best_round"]) for m in per_seed),
                ",".join(ran),
                "-" if paper is None else f"{paper:.2f}",
                "-" if paper is None or ours is None else f"{100 * ours - paper:+.2f}",
                f"{round_seconds(entry):.1f}",
                f"{sum(wall[(method, s)] for s in seeds) / 60:.1f}",
            ]
        )
    for method, published in ((paper_entry or {}).get("values") or {}).items():
        if method not in methods:
            state = "unfinished (Not finished, above)" if method in started else "not run yet"
            if method not in started and method in failed_methods:
                state = "failed (Failed, above)"
            rows.append([method, "-", state, *("-" for _ in extra), "-", "-", f"{published[0]:.2f}", "-", "-", "-"])
    caption = "results" + (f" beside {paper_entry['source']}" if paper_entry else "")
    section.tables.append((caption + " (rounds run: * = stopped by the plateau rule)", header, rows))
    ours = {m: e["best_accuracy"] for m, e in entries.items() if e.get("best_accuracy") is not None}
    published = {m: v[0] for m, v in ((paper_entry or {}).get("values") or {}).items()}
    agreement = ranking_table(ours, published)
    if agreement:
        section.tables.append(agreement)
    gains = ala_gain_table(ours, published)
    if gains:
        section.tables.append(gains)
    bases = tta_bases(methods)
    if bases:
        seeds = sorted({s for _, s in histories})
        tta = []
        for method, found in time_to_accuracy(histories, bases, seeds).items():
            for tta_key, value in found.items():
                improvement = value["improvement"]
                tta.append(
                    [
                        method,
                        tta_key[len("tta_") :],
                        improvement if isinstance(improvement, str) else f"x{improvement:.2f}",
                        f"{value['reached_seeds']}/{len(value['seeds'])}",
                    ]
                )
        if tta:
            section.tables.append(
                (
                    "time to accuracy (SosicFL paper, Section 4.1): the round the base first reaches its best, "
                    "over the round the method does",
                    ["method", "metric vs base", "improvement", "seeds reaching"],
                    tta,
                )
            )
    return section

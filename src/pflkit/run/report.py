"""``pflkit report``: runs and sweeps collected into one Markdown file and one self-contained
HTML page (figures embedded), with the papers' numbers beside ours where a config names them."""

from __future__ import annotations

import base64
import html
import json
import math
import shlex
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import scipy.stats

from ..algorithms.registry import ALGORITHMS, config_sections, parse_name
from ..config import load_config
from ..data.partition import PartitionSpec
from ..federation import ResultsFolder
from ..federation.results import EXECUTION_KEYS
from ..reporting import summarize
from ..federation.runner import tta_bases
from ..reporting.summary import round_seconds, time_to_accuracy
from ..reporting.paper import paper_cell

#: Summary metrics of the main table (shown where a run recorded them), accuracies in %.
MAIN_COLUMNS = (("best acc", "best_accuracy"), ("final acc", "final_accuracy"),
                ("best local acc", "best_local_accuracy"), ("best global acc", "best_global_accuracy"),
                ("best global client-dist acc", "best_global_client_accuracy"))


@dataclass
class Section:
    """A report section: a title, lines of text, tables (header, rows) and figures."""

    title: str
    text: list[str] = field(default_factory=list)
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)
    figures: list[tuple[Path, str]] = field(default_factory=list)


def _pct(entry: dict[str, Any], key: str, multi: bool) -> str:
    if key not in entry or entry[key] is None or (isinstance(entry[key], float) and math.isnan(entry[key])):
        return "-"
    text = f"{100 * entry[key]:.2f}"
    return text + (f" ± {100 * entry.get(key + '_std', 0.0):.2f}" if multi else "")


def run_section(folder: Path) -> Section:
    """The section of one results folder: its setting, main table, paper comparison, time to
    accuracy and figures."""
    results = ResultsFolder(folder)
    if not results.config_path.is_file():
        raise ValueError(f"{folder} is not a results folder (no config.toml)")
    config = load_config(results.config_path)
    section = Section(f"{config.name} ({folder.name})")
    if results.summary_path.is_file():
        summary: dict[str, Any] = _read_json(results.summary_path)
    else:
        summary = finished_part(results, config.train.rounds)
        seeds = {m: sorted(int(s) for s in e["seeds"]) for m, e in summary.items()}
        section.text.append(f"**Unfinished run** (no summary.json yet): numbers over the (method, seed) runs that "
                            f"finished, seeds {seeds}.")
    multi = any(e.get("num_seeds", 1) > 1 for e in summary.values())
    section.text.append(
        f"{config.dataset}, model {config.model}, partition {config.partition.method}, "
        f"{config.partition.num_clients} clients, join ratio {config.run.join_ratio}, {config.train.rounds} rounds, "
        f"seeds {config.seeds}, test set {config.partition.test_set}; "
        f"metrics in %{' (mean ± std over seeds)' if multi else ''}.")
    columns = [(name, key) for name, key in MAIN_COLUMNS if any(key in e for e in summary.values())]
    header = ["method", *(n for n, _ in columns), "s/round", "init (ALA) s/round", "values down+up / client / round",
              "MB / round"]
    rows = []
    for method, entry in summary.items():
        floats = entry.get("mean_down_floats_per_client", math.nan) + entry.get("mean_up_floats_per_client", math.nan)
        megabytes = (entry.get("mean_down_bytes", math.nan) + entry.get("mean_up_bytes", math.nan)) / 1e6
        rows.append([method, *(_pct(entry, key, multi) for _, key in columns),
                     f"{round_seconds(entry):.3f}", f"{entry.get('init_seconds_per_round', math.nan):.3f}",
                     "-" if math.isnan(floats) else f"{floats:,.0f}",
                     "-" if math.isnan(megabytes) else f"{megabytes:.2f}"])
    section.tables.append(("results", header, rows))
    cell = paper_cell(config.paper_table) if config.paper_table else None
    if cell and cell.get("cost"):
        section.tables.append(cost_table(summary, cell))
    if cell and cell["metrics"]:
        prow = []
        for method, entry in summary.items():
            published = cell["values"].get(method)
            if published is None:
                continue
            for metric, value in zip(cell["metrics"], published):
                ours = entry.get(metric)
                diff = "-" if ours is None else f"{100 * ours - value:+.2f}"
                prow.append([method, metric, _pct(entry, metric, multi), f"{value:.2f}", diff])
        section.tables.append((f"beside the paper: {cell['source']}", ["method", "metric", "pflkit", "paper",
                                                                       "pflkit − paper"], prow))
    published = paper_cell(config.paper_table).get("tta", {}) if config.paper_table else {}
    tta = []
    for m, e in summary.items():
        for key, v in e.items():
            if not key.startswith("tta_"):
                continue
            ours = v["improvement"] if isinstance(v["improvement"], str) else f"x{v['improvement']:.2f}"
            paper = published.get(m)
            side = None if paper is None else paper[0 if key.startswith("tta_global") else 1]
            tta.append([m, key[len("tta_"):], ours, f"{v['reached_seeds']}/{len(v['seeds'])}",
                        "-" if side is None else f"x{side:.1f}"])
    if tta:
        section.tables.append(("time to accuracy (SosicFL §4.13; paper: its Table 5)",
                               ["method", "metric vs base", "improvement", "seeds reaching", "paper"], tta))
    for png in sorted(results.plots.glob("*.png")):
        section.figures.append((png, png.stem.replace("_", " ")))
    return section


def _read_json(path: Path) -> dict[str, Any]:
    """A summary.json or sweep.json: a JSON object, or an error naming the file."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not the object pflkit writes: "
                         "the folder is damaged or was not written by pflkit")
    return data


def portable(word: str) -> str:
    """An override as a report shows it: the dataset folder as ``DIR`` (never a path of the
    machine that made the report)."""
    key, _, _ = word.partition("=")
    return f"{key}=DIR" if key in ("data_dir", "pretrained") else word


def finished_part(results: ResultsFolder, rounds: int) -> dict[str, Any]:
    """The summary of an unfinished run over its finished (method, seed) runs: those whose
    metrics hold the final evaluation (round ``rounds``)."""
    done = {key: h for key, h in _histories(results).items() if any(r["round"] == rounds for r in h)}
    if not done:
        raise ValueError(f"{results.root} is not a finished results folder and none of its runs has finished yet "
                         "(an unfinished run is continued with pflkit run --resume)")
    methods = list(dict.fromkeys(m for m, _ in done))
    return {m: summarize(done, [m], sorted(s for n, s in done if n == m))[m] for m in methods}


def cost_table(summary: dict[str, Any], cell: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Minutes per round and values sent per client and round in units of Σ (FedAvg's download,
    which is the whole model), beside the paper's cost table."""
    sigma = summary.get("fedavg", {}).get("mean_down_floats_per_client")
    rows = []
    for method, entry in summary.items():
        floats = entry.get("mean_down_floats_per_client", math.nan) + entry.get("mean_up_floats_per_client", math.nan)
        units = f"{floats / sigma:.2f}Σ" if sigma and not math.isnan(floats) else f"{floats:,.0f} values"
        minutes, formula = cell["cost"].get(method, (math.nan, "-"))
        rows.append([method, f"{round_seconds(entry) / 60:.2f}",
                     "-" if math.isnan(minutes) else f"{minutes:.2f}", units, formula])
    return (f"cost beside the paper: {cell['source']}",
            ["method", "min/round", "paper min/iter", "sent per client and round", "paper"], rows)


def sweep_section(folder: Path) -> Section:
    record = _read_json(folder / "sweep.json")
    fixed = [portable(w) for w in record["fixed"]]
    section = Section(f"sweep {folder.name}: {', '.join(a['key'] for a in record['axes'])}")
    section.text.append(f"config {record['config'] or '(defaults)'}, fixed {' '.join(fixed) or '-'}; "
                        f"metric {record['metric']}" + ("; DIR: the dataset's folder." if fixed != record["fixed"]
                                                        else "."))
    axes = [f"{a['key']}={json.dumps(a['values'], separators=(',', ':'))}" for a in record["axes"]]
    words = [*([record["config"]] if record["config"] else []), *fixed, *axes]
    section.text.append("command: pflkit sweep " + " ".join(shlex.quote(w) for w in words)
                        + f" --metric {record['metric']} --out {shlex.quote(folder.name)}")
    failed = [c for c in record["cells"] if "error" in c]
    if failed:
        section.text.append(f"**{len(failed)} cell(s) failed**: " + "; ".join(f"{c['folder']}: {c['error']}"
                                                                           for c in failed))
    lines = (folder / "sweep.md").read_text().strip().splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    section.tables.append(("sweep", cells[0], cells[2:]))
    if (folder / "sweep.png").is_file():
        section.figures.append((folder / "sweep.png", f"{record['metric']} against {record['axes'][0]['key']}"))
    if record["cells"]:
        config = load_config(folder / record["cells"][0]["folder"] / "config.toml")
        if config.paper_table and paper_cell(config.paper_table).get("sweep"):
            section.tables.append(sweep_paper_table(record, paper_cell(config.paper_table)))
    return section


def sweep_paper_table(record: dict[str, Any], cell: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Each sweep cell's value of the paper's swept metric beside the paper's number for the same
    setting (cells whose swept value the paper did not run show "-")."""
    sweep = cell["sweep"]
    key, metric = sweep["key"], sweep["metric"]
    if key not in [a["key"] for a in record["axes"]]:
        raise ValueError(f"paper_table {cell['source']!r} sweeps {key}, which this sweep does not "
                         f"(its axes: {', '.join(a['key'] for a in record['axes'])})")
    others = [a["key"] for a in record["axes"] if a["key"] != key]
    params = sweep.get("params", {})
    rows = []
    for c in record["cells"]:
        entry = c.get("summary", {}).get(sweep["algorithm"])
        if entry is None:
            continue
        value = c["values"][key]
        paper = next((v for k, v in sweep["values"].items() if k == value), None)
        multi = entry.get("num_seeds", 1) > 1
        ours = entry.get(metric)
        diff = "-" if ours is None or paper is None else f"{100 * ours - paper:+.2f}"
        row = [str(value), *(str(c["values"][k]) for k in others), _pct(entry, metric, multi),
               "-" if paper is None else f"{paper:.2f}", diff]
        if params:  # the "Param." row: ALA's learnable weights, ours and the paper's
            theirs = params.get(value)
            row += [f"{entry['ala_weights']:,}" if "ala_weights" in entry else "-",
                    "-" if theirs is None else f"{theirs:,}"]
        rows.append(row)
    header = [key, *others, f"pflkit {metric}", "paper", "pflkit − paper"]
    if params:
        header += ["ALA weights", "paper ALA weights"]
    return f"beside the paper: {cell['source']}", header, rows


#: Columns a table of cells shows where its runs recorded them (best values; local risk: lowest).
TABLE_EXTRA_COLUMNS = (("best global acc", "best_global_accuracy"),
                       ("best global client-dist acc", "best_global_client_accuracy"),
                       ("best local acc", "best_local_accuracy"), ("best local risk", "best_local_risk"))


def cell_folders(folder: Path) -> list[Path]:
    """The results folders directly under ``folder`` (a sweep's or a table's cells)."""
    return sorted(p for p in folder.iterdir() if (p / "config.toml").is_file()) if folder.is_dir() else []


def one_setting(cells: Sequence[Path]) -> bool:
    """Whether the cells' configs differ in nothing but their methods, seeds, names and execution
    keys (``EXECUTION_KEYS``: a cell run or resumed with other workers computes the same): one table.

    A method's config section counts only for the cells that run it (every saved config lists every
    section; a key added to one method later must not split the cells of the others), and then must
    match between all of them."""
    owned = set(config_sections())

    def read(cell: Path) -> dict[str, Any]:  # the saved (resolved) tables: no validation, no warnings per cell
        try:
            return tomllib.loads((cell / "config.toml").read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{cell / 'config.toml'} is not a readable config ({exc})") from None

    def used_sections(table: dict[str, Any]) -> set[str]:
        names = set()
        for name in table.get("algorithms", []):
            try:
                base, modifiers = parse_name(name)
            except (KeyError, ValueError):
                return owned  # an unknown method: every section counts
            names.add(ALGORITHMS[base].section or base)
            names.update(m.section for m in modifiers)
        return names

    def computed(table: dict[str, Any]) -> dict[str, Any]:  # without the keys that only say how a cell ran
        table = {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
        for key in EXECUTION_KEYS:
            section, name = key.split(".", 1)
            if isinstance(table.get(section), dict):
                table[section].pop(name, None)
        return table

    tables = [computed(read(c)) for c in cells]
    shared = [{k: v for k, v in t.items() if k not in ("algorithms", "seeds", "name") and k not in owned}
              for t in tables]
    if any(s != shared[0] for s in shared[1:]):
        return False
    seen: dict[str, Any] = {}
    for table in tables:
        for section in used_sections(table) & owned:
            if seen.setdefault(section, table.get(section)) != table.get(section):
                return False
    return True


def _histories(results: ResultsFolder) -> dict[tuple[str, int], list[dict[str, Any]]]:
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    if results.metrics_path.is_file():
        for line in results.metrics_path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault((record["algorithm"], int(record["seed"])), []).append(record)
    return out


def _status(results: ResultsFolder) -> dict[str, Any]:
    try:
        return results.status()
    except (OSError, RuntimeError, ValueError):
        return {"status": "unreadable"}


def partition_words(spec: PartitionSpec) -> str:
    """The partition with the parameter that tells its tables apart (Dir(0.1) from Dir(0.05), ...)."""
    detail = {"dirichlet": f"alpha {spec.alpha}", "label_dirichlet": f"alpha {spec.alpha}",
              "pathological": f"{spec.classes_per_client} classes per client",
              "kfold": f"{spec.num_folds} folds"}.get(spec.method)
    return f"{spec.method} ({detail})" if detail else spec.method


def table_section(folder: Path, cells: Sequence[Path]) -> Section:
    """One setting's cells (results folders that differ only in methods and seeds) as one table:
    per method the best accuracy (mean ± std over seeds), the round it was reached and the rounds
    run (the plateau rule or the cap), the paper's number and the difference, and the wall time;
    unfinished cells are listed with the round they reached, their best so far and the machine."""
    config = load_config(cells[0] / "config.toml")
    histories: dict[tuple[str, int], list[dict[str, Any]]] = {}
    wall: dict[tuple[str, int], float] = {}
    machines: set[str] = set()
    unfinished = []
    started: set[str] = set()  # methods with an unfinished run
    for cell in cells:
        results = ResultsFolder(cell)
        status = _status(results)
        runs = _histories(results)
        done = {k: h for k, h in runs.items() if h and "final_pass_seconds" in h[-1]}
        histories.update(done)
        for key, history in done.items():
            wall[key] = sum(r.get("seconds", 0.0) for r in history) + history[-1]["final_pass_seconds"]
        if done:
            machines.add(str(status.get("machine") or status.get("host", "?")))
        for key in sorted(set(runs) - set(done)):
            started.add(key[0])
            judged = config.run.plateau_metric if any(config.run.plateau_metric in r for r in runs[key]) else "accuracy"
            scored = [r for r in runs[key] if judged in r]
            best = max(scored, key=lambda r: r[judged]) if scored else None
            so_far = "" if best is None else (f", best {'' if judged == 'accuracy' else judged + ' '}so far "
                                              f"{100 * best[judged]:.2f} at round {best['round']}")
            machine = status.get("machine")
            unfinished.append(f"{cell.name} ({key[0]}, seed {key[1]}: {status.get('status', '?')}, reached round "
                              f"{max(r['round'] for r in runs[key])}{so_far}{f', on {machine}' if machine else ''})")
        if not runs:
            unfinished.append(f"{cell.name} ({status.get('status', '?')}, no round yet)")
    methods = list(dict.fromkeys(m for m, _ in histories))
    cell = paper_cell(config.paper_table) if config.paper_table else None
    plateau = (f"a run stops once its best {config.run.plateau_metric} has not improved by more than "
               f"{config.run.plateau_points} points over its last {config.run.plateau_evaluations} evaluations, "
               f"at most {config.train.rounds} rounds" if config.run.plateau_evaluations
               else f"{config.train.rounds} rounds")
    section = Section(f"{config.name} ({folder.name}): {len(cells)} cell{'s' if len(cells) != 1 else ''}")
    section.text.append(
        f"{config.dataset}, model {config.model}, partition {partition_words(config.partition)}, "
        f"{config.partition.num_clients} clients, join ratio {config.run.join_ratio}; {plateau}. Accuracies in % "
        f"(mean ± std over seeds where there are several). Each cell is `pflkit run {folder.name}/<cell>/config.toml` "
        "(its data_dir names the dataset's folder as ${PFLKIT_DATA}/...).")
    total = sum(wall.values())
    section.text.append(f"Machine{'s' if len(machines) > 1 else ''}: {'; '.join(sorted(machines)) or '-'}. "
                        f"Wall time of the finished runs {total / 3600:.2f} h.")
    if unfinished:
        section.text.append("**Not finished**: " + "; ".join(unfinished) + ".")
    entries = {m: summarize(histories, [m], sorted(s for n, s in histories if n == m))[m] for m in methods}
    extra = [(name, key) for name, key in TABLE_EXTRA_COLUMNS if any(key in e for e in entries.values())]
    header = ["method", "seeds", "best acc", *(n for n, _ in extra), "best acc at round", "rounds run", "paper",
              "pflkit − paper", "s/round", "wall min (all seeds)"]
    rows = []
    for method, entry in entries.items():
        seeds = sorted(s for m, s in histories if m == method)
        per_seed = [entry["seeds"][str(s)] for s in seeds]
        ran = [f"{m['rounds']}{'*' if histories[(method, s)][-1].get('stopped') else ''}"
               for m, s in zip(per_seed, seeds)]
        published = (cell or {}).get("values", {}).get(method)
        paper = published[0] if published else None
        ours = entry.get("best_accuracy")
        multi = len(seeds) > 1
        rows.append([method, ",".join(map(str, seeds)), _pct(entry, "best_accuracy", multi),
                     *(_pct(entry, key, multi) for _, key in extra),
                     ",".join(str(m["best_round"]) for m in per_seed), ",".join(ran),
                     "-" if paper is None else f"{paper:.2f}",
                     "-" if paper is None or ours is None else f"{100 * ours - paper:+.2f}",
                     f"{round_seconds(entry):.1f}", f"{sum(wall[(method, s)] for s in seeds) / 60:.1f}"])
    for method, published in ((cell or {}).get("values") or {}).items():
        if method not in methods:
            state = "unfinished (Not finished, below)" if method in started else "not run yet"
            rows.append([method, "-", state, *("-" for _ in extra), "-", "-", f"{published[0]:.2f}", "-",
                         "-", "-"])
    caption = "results" + (f" beside {cell['source']}" if cell else "")
    section.tables.append((caption + " (rounds run: * = stopped by the plateau rule)", header, rows))
    ours = {m: e["best_accuracy"] for m, e in entries.items() if e.get("best_accuracy") is not None}
    published = {m: v[0] for m, v in ((cell or {}).get("values") or {}).items()}
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
            for key, value in found.items():
                improvement = value["improvement"]
                tta.append([method, key[len("tta_"):], improvement if isinstance(improvement, str)
                            else f"x{improvement:.2f}", f"{value['reached_seeds']}/{len(value['seeds'])}"])
        if tta:
            section.tables.append(("time to accuracy (SosicFL §4.13): the round the base first reaches its best, "
                                   "over the round the method does", ["method", "metric vs base", "improvement",
                                                                      "seeds reaching"], tta))
    return section


def ranking_table(ours: dict[str, float], paper: dict[str, float], base: str = "fedavg"
                  ) -> tuple[str, list[str], list[list[str]]] | None:
    """How our ranking and gaps agree with the paper's over the methods both have (best
    accuracy, ours a fraction, the paper's in %): a table of ranks and gaps to ``base`` whose
    caption gives Kendall's tau and how many methods are on the same side of ``base`` in both.
    None where fewer than two methods have both numbers."""
    common = [m for m in ours if m in paper]
    if len(common) < 2:
        return None
    mine = {m: 100 * ours[m] for m in common}
    rank_ours = {m: i + 1 for i, m in enumerate(sorted(common, key=lambda m: -mine[m]))}
    rank_paper = {m: i + 1 for i, m in enumerate(sorted(common, key=lambda m: -paper[m]))}
    tau = scipy.stats.kendalltau([mine[m] for m in common], [paper[m] for m in common]).statistic
    has_base = base in common
    text = (f"ranks and gaps (points of best accuracy) beside the paper: over the {len(common)} methods that both "
            "have, Kendall's tau between our best accuracies and the paper's is "
            + ("undefined (all tied on one side)." if math.isnan(tau) else
               f"{tau:.2f} (1: the same order, 0: unrelated)."))
    if has_base:
        others = [m for m in common if m != base]
        same = [m for m in others if (mine[m] - mine[base]) * (paper[m] - paper[base]) > 0]
        apart = [m for m in others if m not in same]
        text += (f" {len(same)} of {len(others)} methods are on the same side of {base} in both"
                 + (f" (on the other side in one of them: {', '.join(apart)})." if apart else "."))
    header = ["method", "pflkit rank", "paper rank"]
    if has_base:
        header += [f"pflkit − {base}", f"paper − {base}"]
    rows = []
    for m in sorted(common, key=lambda m: rank_ours[m]):
        row = [m, str(rank_ours[m]), str(rank_paper[m])]
        if has_base:
            row += [f"{mine[m] - mine[base]:+.2f}", f"{paper[m] - paper[base]:+.2f}"]
        rows.append(row)
    return text, header, rows


def _with_ala(method: str, numbers: dict[str, float]) -> str | None:
    """The name under which ``numbers`` hold ``method`` + ALA (FedAvg + ALA is FedALA)."""
    names = [f"{method}+ala"] + (["fedala"] if method == "fedavg" else [])
    return next((n for n in names if n in numbers), None)


def ala_gain_table(ours: dict[str, float], paper: dict[str, float]
                   ) -> tuple[str, list[str], list[list[str]]] | None:
    """What ALA adds to each method X that ran both as X and as X + ALA (``X+ala``; for FedAvg,
    FedALA), in points of best accuracy, with the paper's gain where its table has both; None
    where no pair ran."""
    rows = []
    for m in ours:
        with_ala = _with_ala(m, ours) if not m.endswith("+ala") else None
        if with_ala is None:
            continue
        gain = 100 * (ours[with_ala] - ours[m])
        theirs = _with_ala(m, paper) if m in paper else None
        rows.append([m, with_ala, f"{100 * ours[m]:.2f}", f"{100 * ours[with_ala]:.2f}", f"{gain:+.2f}",
                     "-" if theirs is None else f"{paper[theirs] - paper[m]:+.2f}"])
    if not rows:
        return None
    return ("X + ALA: what the ALA module adds to each method run both ways",
            ["X", "X + ALA", "X best acc", "X + ALA best acc", "gain", "paper gain"], rows)


def _header(title: str, command: str | None, intro: str | None) -> list[str]:
    lines = [f"# {title}", ""]
    if command:
        lines += ["Generated by:", "", "```bash", command, "```", "",
                  "Every run below is reproduced by `pflkit run <its folder>/config.toml` (the resolved config "
                  "it ran with; add `data_dir=DIR` where the dataset lives elsewhere), every sweep by the "
                  "`pflkit sweep` command in its section.", ""]
    if intro:
        lines += [intro.strip(), ""]
    return lines


def _markdown(sections: Sequence[Section], figures: Path, title: str = "pflkit report",
              command: str | None = None, intro: str | None = None) -> str:
    out = _header(title, command, intro)
    for i, s in enumerate(sections):
        out += [f"## {s.title}", "", *s.text, ""]
        for caption, header, rows in s.tables:
            out += [f"**{caption}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            out += ["| " + " | ".join(r) + " |" for r in rows] + [""]
        for png, caption in s.figures:
            name = f"{i}-{png.parent.parent.name if png.parent.name == 'plots' else png.parent.name}-{png.name}"
            shutil.copyfile(png, figures / name)
            out += [f"![{caption}](figures/{name})", ""]
    return "\n".join(out)


def _html(sections: Sequence[Section], title: str = "pflkit report", command: str | None = None,
          intro: str | None = None) -> str:
    esc = html.escape
    body = [f"<h1>{esc(title)}</h1>"]
    if command:
        body.append(f"<p>Generated by: <code>{esc(command)}</code></p>")
    body += [f"<p>{esc(p.strip())}</p>" for p in (intro or "").split("\n\n") if p.strip()]
    for s in sections:
        body.append(f"<h2>{esc(s.title)}</h2>")
        body += [f"<p>{esc(t)}</p>" for t in s.text]
        for caption, header, rows in s.tables:
            body.append(f"<table><caption>{esc(caption)}</caption><tr>"
                        + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>")
            body += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows]
            body.append("</table>")
        for png, caption in s.figures:
            data = base64.b64encode(png.read_bytes()).decode()
            body.append(f'<figure><img alt="{esc(caption)}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{esc(caption)}</figcaption></figure>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:3px 8px;"
             "text-align:right}td:first-child,th:first-child{text-align:left}caption{font-weight:bold;"
             "text-align:left;padding:4px 0}img{max-width:100%}figure{margin:1em 0}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{style}</style>"
            f"</head><body>{''.join(body)}</body></html>\n")


def build_report(paths: Sequence[str | Path], out: str | Path, *, name: str = "report", title: str = "pflkit report",
                 command: str | None = None, intro: str | None = None) -> tuple[Path, Path]:
    """Write ``<name>.md`` (figures copied into ``figures/`` next to it) and ``<name>.html``
    (figures embedded) into ``out`` for the given results folders and sweep folders;
    ``command``, the one that made the report, and the Markdown text ``intro`` stand at the top."""
    if not paths:
        raise ValueError("pflkit report needs at least one results or sweep folder")
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"--name {name!r} must be a plain file name (no folders): the report is written as "
                         "<--out>/<name>.md and <name>.html")
    sections = []
    for path in map(Path, paths):
        cells = cell_folders(path) if not (path / "config.toml").is_file() else []
        if cells and one_setting(cells):
            sections.append(table_section(path, cells))
        elif (path / "sweep.json").is_file():
            sections.append(sweep_section(path))
        elif path.is_dir():
            sections.append(run_section(path))
        else:
            raise ValueError(f"{path} is neither a results folder nor a sweep folder")
    out = Path(out)
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    md, page = out / f"{name}.md", out / f"{name}.html"
    md.write_text(_markdown(sections, figures, title, command, intro) + "\n")
    page.write_text(_html(sections, title, command, intro))
    return md, page

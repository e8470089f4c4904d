"""What a report reads from results folders (through ``federation.ResultsFolder``): which folders
under a parent are cells, whether cells are one setting (one table), what an unfinished run has
finished, and a run's status however damaged its run.json."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...config.loading import resolved
from ...federation import ResultsFolder
from ...federation.results import CONFIG_FILE, EXECUTION_KEYS
from ...methods import REGISTRY, config_sections
from ...reporting import summarize


def cell_folders(folder: Path) -> list[Path]:
    """The results folders directly under ``folder`` (a sweep's or a table's cells)."""
    return sorted(p for p in folder.iterdir() if ResultsFolder(p).has_config()) if folder.is_dir() else []


def one_setting(cells: Sequence[Path]) -> bool:
    """Whether the cells' configs differ in nothing but their methods, seeds, names and execution
    keys (``EXECUTION_KEYS``: a cell run or resumed with other workers computes the same): one table.
    Each config is compared resolved by the current schema: a key added to pflkit after a cell ran
    takes its default there, as it would in a rerun of that cell.

    A method's config section counts only for the cells that run it (every saved config lists every
    section; a key added to one method later must not split the cells of the others), and then must
    match between all of them. Cells whose methods all keep batch norm on the client (FedBN) may
    run another model than the others (the table's model may have no batch norm): the same one
    among them (``own_models`` names it for tables and reports)."""
    owned = set(config_sections())

    def used_sections(table: dict[str, Any]) -> set[str]:
        names = set()
        for name in table.get("algorithms", []):
            try:
                names.update(REGISTRY.resolve(name).sections)
            except (KeyError, ValueError):
                return owned  # an unknown method: every section counts
        return names

    def computed(table: dict[str, Any]) -> dict[str, Any]:  # without the keys that only say how a cell ran
        table = {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
        for key in EXECUTION_KEYS:
            section, name = key.split(".", 1)
            if isinstance(table.get(section), dict):
                table[section].pop(name, None)
        return table

    def current(cell: Path) -> dict[str, Any]:  # the saved table, every key the schema now has filled in
        results = ResultsFolder(cell)
        table = results.config_table()
        try:
            return resolved(table, results.where(CONFIG_FILE))
        except ValueError:  # no longer loads (ConfigError too): compared as saved
            return table

    tables = [computed(current(c)) for c in cells]
    own = [needs_batch_norm(t.get("algorithms", [])) for t in tables]
    shared = [
        {k: v for k, v in t.items() if k not in ("algorithms", "seeds", "name", "model") and k not in owned}
        for t in tables
    ]
    if any(s != shared[0] for s in shared[1:]):
        return False
    for batch_norm in (False, True):  # one model for the common cells, one for the batch-norm ones
        if len({t.get("model") for t, o in zip(tables, own) if o == batch_norm}) > 1:
            return False
    seen: dict[str, Any] = {}
    for table in tables:
        for section in used_sections(table) & owned:
            if seen.setdefault(section, table.get(section)) != table.get(section):
                return False
    return True


def needs_batch_norm(methods: Sequence[str]) -> bool:
    """Whether every one of ``methods`` keeps batch norm on its clients (and so needs a model with
    it): such cells may run another model than the rest of their table."""
    try:
        return bool(methods) and all(REGISTRY.resolve(m).cls.personal_part == "norm" for m in methods)
    except (KeyError, ValueError):
        return False


def own_models(cells: Sequence[Path]) -> tuple[str | None, dict[str, str]]:
    """One table's model (that of its cells whose methods run on any model) and, per method that
    ran on another (a batch-norm method, see ``one_setting``), that model."""
    models: dict[str, str] = {}
    common: str | None = None
    for cell in cells:
        table = ResultsFolder(cell).config_table()
        methods, model = table.get("algorithms", []), str(table.get("model"))
        if needs_batch_norm(methods):
            models.update({m: model for m in methods})
        elif common is None:
            common = model
    if common is None:  # batch-norm methods alone: their model is the table's
        return next(iter(models.values()), None), {}
    return common, {m: model for m, model in models.items() if model != common}


def finished_part(results: ResultsFolder, rounds: int) -> dict[str, Any]:
    """The summary of an unfinished run over its finished (method, seed) runs: those whose
    metrics hold the final evaluation (round ``rounds``)."""
    done = {key: h for key, h in results.histories().items() if any(r["round"] == rounds for r in h)}
    if not done:
        raise ValueError(
            f"{results.root} is not a finished results folder and none of its runs has finished yet "
            "(an unfinished run is continued with pflkit run --resume)"
        )
    methods = list(dict.fromkeys(m for m, _ in done))
    return {m: summarize(done, [m], sorted(s for n, s in done if n == m))[m] for m in methods}


def run_status(results: ResultsFolder) -> dict[str, Any]:
    """The folder's run.json; ``{"status": "unreadable"}`` where it cannot be read."""
    try:
        return results.status()
    except (OSError, RuntimeError, ValueError):
        return {"status": "unreadable"}

"""``build_report``: each folder given becomes a section (a table of cells of one setting, a sweep,
or one run), written as ``<name>.md`` and ``<name>.html``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ...federation import ResultsFolder
from ...federation.packing import has_sweep_record
from .folders import cell_folders, one_setting
from .render import to_html, to_markdown
from .sections import run_section, sweep_section, table_section


def build_report(
    paths: Sequence[str | Path],
    out: str | Path,
    *,
    name: str = "report",
    title: str = "pflkit report",
    command: str | None = None,
    intro: str | None = None,
) -> tuple[Path, Path]:
    """Write ``<name>.md`` (figures copied into ``figures/`` next to it) and ``<name>.html``
    (figures embedded) into ``out`` for the given results folders and sweep folders;
    ``command``, the one that made the report, and the Markdown text ``intro`` stand at the top."""
    if not paths:
        raise ValueError("pflkit report needs at least one results or sweep folder")
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(
            f"--name {name!r} must be a plain file name (no folders): the report is written as "
            "<--out>/<name>.md and <name>.html"
        )
    sections = []
    for path in map(Path, paths):
        cells = cell_folders(path) if not ResultsFolder(path).has_config() else []
        if cells and one_setting(cells):
            sections.append(table_section(path, cells))
        elif has_sweep_record(path):
            sections.append(sweep_section(path))
        elif path.is_dir():
            sections.append(run_section(path))
        else:
            raise ValueError(f"{path} is neither a results folder nor a sweep folder")
    out = Path(out)
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    md, page = out / f"{name}.md", out / f"{name}.html"
    md.write_text(to_markdown(sections, figures, title, command, intro) + "\n")
    page.write_text(to_html(sections, title, command, intro))
    return md, page

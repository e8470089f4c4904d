"""``pflkit report``: runs and sweeps collected into one Markdown file and one self-contained
HTML page (figures embedded), with the papers' numbers beside ours where a config names them.

One module per job: ``folders`` (what is read from results folders, through
``federation.ResultsFolder``), ``sections`` (a run, a sweep, or one setting's cells as a table),
``comparison`` (the papers' numbers beside ours), ``render`` (Markdown and HTML) and ``build``
(``build_report``, which puts them together)."""

from .build import build_report
from .comparison import ala_gain_table, cost_table, metrics_table, ranking_table, sweep_paper_table, tta_table
from .folders import cell_folders, finished_part, one_setting, run_status
from .render import Section, pct, to_html, to_markdown
from .sections import (
    MAIN_COLUMNS,
    TABLE_EXTRA_COLUMNS,
    partition_words,
    portable,
    run_section,
    sweep_section,
    table_section,
)

__all__ = [
    "build_report",
    "ala_gain_table",
    "cost_table",
    "metrics_table",
    "ranking_table",
    "sweep_paper_table",
    "tta_table",
    "cell_folders",
    "finished_part",
    "one_setting",
    "run_status",
    "Section",
    "pct",
    "to_html",
    "to_markdown",
    "MAIN_COLUMNS",
    "TABLE_EXTRA_COLUMNS",
    "partition_words",
    "portable",
    "run_section",
    "sweep_section",
    "table_section",
]

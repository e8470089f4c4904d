"""Writes the generated reference pages into the site as it builds (run by mkdocs-gen-files)."""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).parent))
from reference_pages import cli_page, config_page

for page, text in [("reference/cli.md", cli_page()), ("reference/config.md", config_page())]:
    with mkdocs_gen_files.open(page, "w") as f:
        f.write(text)

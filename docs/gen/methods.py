"""Writes the method pages at docs build time (mkdocs-gen-files): reference/methods/index.md and
reference/methods/<name>.md for every method and alias, from the methods' cards."""

from pathlib import Path

import mkdocs_gen_files

from pflkit.catalogue import load_costs, page_names, render_method_page, render_methods_index

COSTS = load_costs(Path(__file__).resolve().parents[1] / "method-costs-after.json")

with mkdocs_gen_files.open("reference/methods/index.md", "w") as index:
    index.write(render_methods_index())
for name in page_names():
    with mkdocs_gen_files.open(f"reference/methods/{name}.md", "w") as page:
        page.write(render_method_page(name, COSTS))

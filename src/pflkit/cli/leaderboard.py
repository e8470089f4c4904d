"""``pflkit leaderboard``: the one-page leaderboard of the committed result cells."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click

from .app import main
from .common import USER_ERRORS, check_writable_file, fail

#: the committed method-costs files, newest first (a method in several takes the first's): the runs
#: after the closed-form terms and after the lighter steps, the first methods' run, then those of the
#: baselines and of the representation-level methods, and FedBN's (on its batch-norm model; each ratio
#: against the FedAvg of its own run)
COSTS = (
    Path("docs/method-costs-terms.json"),
    Path("docs/method-costs-lighter.json"),
    Path("docs/method-costs-after.json"),
    Path("docs/method-costs-baselines.json"),
    Path("docs/method-costs-representation.json"),
    Path("docs/method-costs-fedbn.json"),
)


@main.command(
    epilog="\b\nExamples:\n  pflkit leaderboard                     # at the repository root: docs/results -> docs/\n"
    "  pflkit leaderboard --results results/tables --out lb.md --methods-dir lb-methods\n"
    "                                         # results/tables/fedala-table7-mnist/ ... (one folder per table)"
)
@click.option(
    "--results",
    "results_root",
    type=click.Path(path_type=Path),
    default=Path("docs/results"),
    show_default=True,
    help="folder of the result cells: one folder per table, named as under docs/results "
    "(fedala-table7-mnist, rotated-mnist, fedacd-mnist-dir0.1, ...), one results folder per method and seed",
)
@click.option(
    "--costs",
    type=click.Path(path_type=Path),
    multiple=True,
    default=COSTS,
    show_default=True,
    help="per-method round costs relative to FedAvg (benchmarks/method_costs.py's JSON); repeat it for "
    "several files of one setting, a method in several taking the first's",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("docs/leaderboard.md"),
    show_default=True,
    help="the Markdown page to write",
)
@click.option(
    "--methods-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("docs/reference/methods"),
    show_default=True,
    help="folder of the method pages (index.md and one page per method, with its rows of these tables)",
)
def leaderboard(results_root: Path, costs: tuple[Path, ...], out: Path, methods_dir: Path) -> None:
    """Write the leaderboard page from the result cells: FedALA's Table 7 on MNIST (best accuracy
    mean ± std over seeds, seeds, round of the best, rounds to the plateau, round cost relative to
    FedAvg, the paper's number) and FedACD's and SosicFL's protocol tables; and the method pages,
    each from its method's card with its rows of these tables. Run at the repository root, it
    reads docs/results and writes docs/leaderboard.md and docs/reference/methods/."""
    from ..run.report.leaderboard import write_leaderboard

    try:
        check_writable_file(out)
        write_leaderboard(results_root, out, costs)
        pages = write_method_pages(methods_dir, results_root, costs)
    except USER_ERRORS as exc:
        fail(exc)
    click.echo(f"wrote {out} and {pages} method pages in {methods_dir}")


def write_method_pages(folder: Path, results_root: Path, costs_path: Path | Sequence[Path]) -> int:
    """Write ``index.md`` and one page per method into ``folder`` (a method page this command wrote
    for a method that no longer exists is removed; other files are left alone); returns the number
    of method pages."""
    from ..catalogue import load_costs, page_names, render_method_page, render_methods_index
    from ..run.report.leaderboard import method_results_markdown

    paths = [p for p in ([costs_path] if isinstance(costs_path, Path) else costs_path) if p.is_file()]
    costs = load_costs(*paths) if paths else None
    folder.mkdir(parents=True, exist_ok=True)
    names = page_names()
    for stale in set(folder.glob("*.md")) - {folder / f"{n}.md" for n in ["index", *names]}:
        first = stale.read_text(encoding="utf-8", errors="replace").partition("\n")[0]
        if first.startswith("# ") and first.endswith(f"(`{stale.stem}`)"):  # a page render_method_page wrote
            stale.unlink()
    (folder / "index.md").write_text(render_methods_index(), encoding="utf-8")
    for name in names:
        page = render_method_page(name, costs, method_results_markdown(results_root, name))
        (folder / f"{name}.md").write_text(page, encoding="utf-8")
    return len(names)

"""Every method's card and documentation page: a card per method, test ids that pytest collects,
pages that name the paper and every settings key, and card-less outside methods that still work."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys

import pytest

from pflkit.algorithms import Algorithm
from pflkit.algorithms.card import MethodCard, Reference, card_of
from pflkit.catalogue import entries, entry, load_costs, page_names, render_method_page, render_methods_index
from pflkit.catalogue.entries import settings_rows
from pflkit.methods import REGISTRY
from tests.support.paths import REPO

PAGES = page_names()


def test_every_method_and_alias_of_the_catalogue_has_a_card():
    assert set(REGISTRY.algorithms) <= set(PAGES) and "fedala" in PAGES
    missing = [e.name for e in entries()[0] if e.card is None and not e.external]
    assert missing == []


def test_a_card_is_not_inherited_by_a_subclass():
    class Mine(REGISTRY.algorithms["fedavg"]):  # type: ignore[misc,valid-type]
        name = "mine"

    assert card_of(REGISTRY.algorithms["fedavg"]) is not None and card_of(Mine) is None


@pytest.mark.parametrize("name", PAGES)
def test_every_page_names_its_paper_and_every_settings_key(name):
    e = entry(name)
    page = render_method_page(name)
    assert page.startswith(f"# {e.full_name} (`{name}`)")
    paper = e.card.paper if e.card else None
    if paper is not None:
        assert (paper.title or paper.authors) in page and str(paper.year) in page
    for key, _, _ in settings_rows(e):
        assert f"`{key}`" in page
    assert "## Results" not in page
    assert "spec §" not in page and "algorithms.md" not in page


def test_the_card_ids_of_tests_are_collected_by_pytest():
    ids = {t for e in entries()[0] if e.card for t in (*e.card.tests, *e.card.pinned)}
    files = sorted({t.split("::")[0] for t in ids})
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    collected = {line.split("[")[0] for line in out.splitlines() if "::" in line}
    missing = [t for t in ids if t not in collected and not ("::" not in t and any(c.startswith(t) for c in collected))]
    assert missing == [], out[-2000:]


def test_pinned_differences_are_strict_xfails():
    for e in entries()[0]:
        for test in e.card.pinned if e.card else ():
            path, name = test.split("::")
            module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
            marks = [m for m in getattr(getattr(module, name), "pytestmark", []) if m.name == "xfail"]
            assert marks and marks[0].kwargs.get("strict") is True, test


def test_step_function_is_what_the_batched_method_trains_with():
    for e in entries()[0]:
        if e.card is None or e.vmap == "one by one":
            continue
        classes = [c for c in e.cls.__mro__ if issubclass(c, Algorithm) and c is not Algorithm]
        uses_step = any("step=" in inspect.getsource(c) for c in classes)
        assert e.card.step_function == uses_step, e.name
        assert e.vmap == ("batched (step function)" if uses_step else "batched")


def test_derived_facts_come_from_the_class():
    assert entry("fedfomo").vmap == "one by one" and not entry("fedfomo").ala
    assert entry("fedavg").ala and not entry("apple").ala and not entry("fedala").ala
    assert entry("fedala").card is not None and entry("fedala").sections == ("fedavg", "fedala")
    assert "`apple+ala` is refused" in render_method_page("apple")
    assert "`join_ratio < 1` is refused" in render_method_page("fedamp")
    with pytest.raises(ValueError, match="see those"):
        entry("fedprox+ala")


def test_a_card_names_its_reference_or_says_why_there_is_none():
    base = dict(full_name="X", paper=None, personalised=True, shares="s", keeps="k", scored="m", client_round="r")
    with pytest.raises(ValueError, match="no_reference"):
        MethodCard(**base)
    with pytest.raises(ValueError, match="not a pytest node id"):
        MethodCard(**base, references=(Reference("a/b", "c"),), tests=("test_x",))


def test_results_and_costs_go_on_the_page(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(
        json.dumps({"config": "c.toml", "rounds": 3, "workers": 1, "methods": {"fedrep": {"cost_vs_fedavg": 1.39}}})
    )
    page = render_method_page("fedrep", load_costs(costs), results="| method | acc |\n|---|---|\n| fedrep | 99 |")
    assert "1.39× FedAvg's" in page and "config `c.toml`, 3 rounds, 1 worker" in page
    assert page.split("## Results\n", 1)[1].lstrip().startswith("| method | acc |")
    assert "Round cost" not in render_method_page("ditto", load_costs(costs))
    more = tmp_path / "more.json"
    methods = {"fedrep": {"cost_vs_fedavg": 9.0}, "ditto": {"cost_vs_fedavg": 2.5}}
    more.write_text(json.dumps({"config": "d.toml", "rounds": 4, "workers": 2, "methods": methods}))
    both = load_costs(costs, more)
    assert "1.39× FedAvg's" in render_method_page("fedrep", both)  # the first file's
    assert "2.50× FedAvg's in the same run (`cost_vs_fedavg` in `more.json`: config `d.toml`, 4 rounds, 2 workers" in (
        render_method_page("ditto", both)
    )


def test_the_committed_costs_file_loads():
    costs = load_costs(REPO / "docs" / "method-costs-after.json")
    assert costs.ratios["fedavg"] == 1.0 and "fedala" in costs.ratios


def test_the_index_links_every_page_relatively():
    index = render_methods_index()
    for name in PAGES:
        assert f"[`{name}`]({name}.md)" in index


def test_an_outside_method_without_a_card_gets_its_docstring(tmp_path, monkeypatch):
    (tmp_path / "cardless_methods.py").write_text(
        '"""Module."""\nfrom pydantic import Field\nfrom pflkit.algorithms import Algorithm, Settings\n\n\n'
        "class OwnSettings(Settings):\n    knob: int = Field(3, description='a knob')\n\n\n"
        'class Own(Algorithm):\n    """Own method: FedAvg with a knob."""\n\n'
        "    name = 'cardless_own'\n    settings_class = OwnSettings\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    page = render_method_page("cardless_methods:Own")
    assert "Own method: FedAvg with a knob." in page and "`cardless_own.knob`" in page and "`3`" in page
    assert entry("cardless_methods:Own").ala


def test_the_leaderboard_command_writes_the_index_and_a_page_per_name(tmp_path):
    from pflkit.cli.leaderboard import write_method_pages

    folder = tmp_path / "methods"
    folder.mkdir()
    (folder / "gone.md").write_text("# Gone (`gone`)\n\na method that no longer exists\n")
    (folder / "notes.md").write_text("# My notes\n")
    count = write_method_pages(folder, REPO / "docs" / "results", REPO / "docs" / "method-costs-after.json")
    written = {p.stem for p in folder.glob("*.md")}
    assert written == {"index", "notes", *PAGES} and count == len(PAGES)
    assert "Round cost" in (folder / "fedrep.md").read_text()

"""Markdown pages of the methods, for the documentation (``pflkit leaderboard`` writes them into
``docs/reference/methods/``): one page per method and alias, and an index."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..algorithms.card import MethodCard
from .entries import Entry, entries, entry, settings_rows

RECONSTRUCTIONS = "../../explanations/reconstructions.md"  # from reference/methods/
DESIGN = "../../explanations/design.md"


@dataclass(frozen=True)
class Costs:
    """Per-method round cost against FedAvg's, and where each was measured (``measured``: method ->
    the file and its setting)."""

    ratios: dict[str, float]
    measured: dict[str, str]


def load_costs(*paths: Path) -> Costs:
    """The ``cost_vs_fedavg`` of every method in ``benchmarks/method_costs.py`` output files, each
    relative to the FedAvg of its own run; a method in several files takes the first file's."""
    ratios: dict[str, float] = {}
    measured: dict[str, str] = {}
    for path in paths:
        data = json.loads(path.read_text(encoding="utf-8"))
        workers = data.get("workers", 1)
        setting = f"config `{data.get('config')}`, {data.get('rounds')} rounds, {workers} worker{'s' * (workers != 1)}"
        if data.get("model"):  # every method of that run, FedAvg too, on another model than the config's
            setting += f", every method on model `{data['model']}`"
        for name, m in data["methods"].items():
            if "cost_vs_fedavg" in m and name not in ratios:
                ratios[name] = float(m["cost_vs_fedavg"])
                measured[name] = f"`{path.name}`: {setting}"
    return Costs(ratios, measured)


def page_names() -> list[str]:
    """The names that get a page: every method and alias that loads."""
    return [e.name for e in entries()[0]]


def cell(text: Any) -> str:
    """``text`` fit for a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def paper_line(card: MethodCard) -> str:
    paper = card.paper
    if paper is None:
        return "No paper: a baseline."
    title = f"*{paper.title}*" if paper.title else "title not recorded"
    linked = f"[{title}]({paper.url})" if paper.url else title
    return f"{linked}, {paper.short}."


def _list(items: tuple[str, ...] | list[str]) -> list[str]:
    return [f"- {item}" for item in items]


def _card_sections(card: MethodCard) -> list[str]:
    kind = "personalised" if card.personalised else "global-model (it scores the received global model)"
    lines = [
        f"**Paper:** {paper_line(card)}",
        "",
        f"**Kind:** {kind}."
        + (" A reconstruction: pflkit's reading where the paper gives no code." if card.reconstruction else ""),
        "",
        f"**Shared with the server:** {card.shares}",
        "",
        f"**Kept on the client:** {card.keeps}",
        "",
        f"**Scored model:** {card.scored}." + (f" {card.scored_detail}" if card.scored_detail else ""),
        "",
        "## Client round",
        "",
        card.client_round,
    ]
    if card.notes:
        lines += ["", *_list(card.notes)]
    lines += ["", "## Reference code", ""]
    if card.references:
        for ref in card.references:
            files = ", ".join(f"`{f}`" for f in ref.files)
            lines.append(f"- [{ref.repository} at {ref.commit}]({ref.url})" + (f": {files}" if files else ""))
    if card.no_reference:
        lines += ["", card.no_reference] if card.references else [card.no_reference]
    if card.tests:
        said = "Tests that compare pflkit with it:" if card.references else "Tests that check it:"
        lines += ["", said, "", *_list([f"`{t}`" for t in card.tests])]
    if card.pinned:
        lines += ["", "Recorded differences pinned by strict xfail tests (each with a partner test):", ""]
        lines += _list([f"`{t}`" for t in card.pinned])
    if card.differences:
        lines += ["", "## Differences from the reference", "", *_list(card.differences)]
    if card.choices:
        lines += ["", "## Choices", "", "| item | pflkit default | option |", "|---|---|---|"]
        lines += [f"| {cell(c.item)} | {cell(c.default)} | {cell(c.option) or '—'} |" for c in card.choices]
    return lines


def render_method_page(name: str, costs: Costs | None = None, results: str | None = None) -> str:
    """The documentation page of the method ``name``: its card, settings, ``+ala`` support, vmap
    batching and round cost; ``results`` (markdown, e.g. its leaderboard rows) is its "Results"
    section, left out when None."""
    e = entry(name)
    lines = [f"# {e.full_name} (`{e.name}`)", ""]
    if e.card is None:
        lines += [e.summary, "", "This method carries no card: see its class's documentation."]
    else:
        lines += _card_sections(e.card)
    lines += ["", "## Settings", ""] + _settings(e)
    lines += ["", "## ALA and engines", ""] + _support(e, costs)
    if results is not None:
        lines += ["", "## Results", "", results.strip()]
    lines += ["", f"Choices shared by every method: [reconstructions]({RECONSTRUCTIONS})."]
    return link_docs("\n".join(lines) + "\n")


def link_docs(text: str) -> str:
    """Mentions of ``docs/<path>.md`` as links relative to ``reference/methods/``."""
    return re.sub(r"(?<!\]\()(?<![/\w])docs/([\w/-]+)\.md", r"[\1](../../\1.md)", text)


def _settings(e: Entry) -> list[str]:
    rows = settings_rows(e)
    if not rows:
        return [f"The section `[{e.sections[0]}]` has no keys; the run's `[train]` settings apply."]
    out = ["| key | default | description |", "|---|---|---|"]
    for key, default, meaning in rows:
        shown = "unset" if default is None else json.dumps(default)
        out.append(f"| `{key}` | `{cell(shown)}` | {cell(meaning)} |")
    return out


def _support(e: Entry, costs: Costs | None) -> list[str]:
    if e.ala:
        target = e.card.ala_initialises if e.card else "the local model"
        ala = f"`{e.name}+ala` runs ALA before its training; ALA initialises {target}."
    elif e.sections[1:]:
        ala = "This name already applies ALA."
    else:
        why = e.cls.ala_refusal or "the method downloads no single model that ALA could initialise"
        ala = f"`{e.name}+ala` is refused: {why}."
    vmap = f"The vmap engine runs its clients {e.vmap}" + (f": {e.vmap_reason}." if e.vmap_reason else ".")
    lines = [f"- {ala}", f"- {vmap} The parallel CPU engine runs every method (see [design]({DESIGN}))."]
    if e.cls.requires_full_participation:
        lines.append("- It needs every client in every round: a config with `join_ratio < 1` is refused.")
    if not e.cls.has_global_model:
        lines.append("- Its server holds no model worth scoring: global-test metrics skip it.")
    if costs is not None and e.name in costs.ratios:
        lines.append(
            f"- Round cost: {costs.ratios[e.name]:.2f}× FedAvg's in the same run (`cost_vs_fedavg` in "
            f"{costs.measured[e.name]}, the parallel engine)."
        )
    return lines


def render_methods_index() -> str:
    """A table of every method and alias: name, method, paper, kind, link to its page."""
    found, problems = entries()
    lines = [
        "# Methods",
        "",
        "Every name `algorithms = [...]` accepts; `X+ala` is any method marked `+ala` with ALA first.",
        "`pflkit algorithms` prints the same list.",
        "",
        "| name | method | paper | kind | `+ala` |",
        "|---|---|---|---|---|",
    ]
    for e in found:
        paper = e.card.paper.short if e.card and e.card.paper else "—"
        kind = "—" if e.card is None else ("personalised" if e.card.personalised else "global")
        yes = "yes" if e.ala else "no"
        lines.append(f"| [`{e.name}`]({e.name}.md) | {cell(e.full_name)} | {cell(paper)} | {kind} | {yes} |")
    lines += ["", *_list(problems)] if problems else []
    return "\n".join(lines) + "\n"

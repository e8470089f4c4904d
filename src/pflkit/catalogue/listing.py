"""``pflkit algorithms``: one line per method, or the same as JSON."""

from __future__ import annotations

from typing import Any

from .entries import Entry, entries


def row(e: Entry) -> dict[str, Any]:
    """What the listing says of one entry (the JSON form)."""
    card = e.card
    paper = card.paper if card else None
    return {
        "name": e.name,
        "full_name": e.full_name,
        "paper": None
        if paper is None
        else {
            "title": paper.title,
            "authors": paper.authors,
            "venue": paper.venue,
            "year": paper.year,
            "url": paper.url,
        },
        "kind": None if card is None else ("personalised" if card.personalised else "global"),
        "scored": card.scored if card else None,
        "vmap": e.vmap,
        "ala": e.ala,
        "ala_name": f"{e.name}+ala" if e.ala else None,
        "reconstruction": card.reconstruction if card else None,
        "summary": None if card else e.summary,
        "external": e.external,
    }


def listing() -> tuple[list[dict[str, Any]], list[str]]:
    """Every method's row, and a line for each outside method that cannot be loaded."""
    found, problems = entries()
    return [row(e) for e in found], problems


HEADER = ("name", "method", "paper", "kind", "scored model", "vmap engine", "+ala")


def format_listing(rows: list[dict[str, Any]]) -> str:
    """Aligned columns, one line per method (a card-less method shows its docstring's summary)."""
    table = [HEADER]
    for r in rows:
        paper = r["paper"]
        short = (
            "—"
            if paper is None
            else f"{paper['authors']}, {(paper['venue'] + ' ') if paper['venue'] else ''}{paper['year']}"
        )
        table.append(
            (
                r["name"],
                r["full_name"],
                short if r["kind"] is not None else (r["summary"] or "")[:60],
                r["kind"] or "—",
                r["scored"] or "—",
                r["vmap"],
                "yes" if r["ala"] else "no",
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    return "\n".join(lines)

"""Reading the tables that docs pages quote from committed cells."""

from __future__ import annotations


def table_rows(text: str, heading: str, header: str = "\n|") -> list[list[str]]:
    """The cells of the first table after ``heading`` whose header line starts with ``header``
    (header and rule skipped; the table ends at its first line that is not a row)."""
    section = text[text.index(heading) :]
    lines = section[section.index(header) :].strip().splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows

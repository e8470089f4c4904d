"""The result cells committed under docs/results/: every cell and file SHA256SUMS lists is there,
byte for byte (a cell's files in its records.tar.xz, a sweep's sweep.json in its sweep.json.xz),
and each cell's summary holds the numbers pflkit's summarizer computes from the cell's records."""

from __future__ import annotations

import hashlib
import lzma
import math
from pathlib import Path
from typing import Any

from pflkit.cli.common import load_cli_config
from pflkit.federation import ResultsFolder
from pflkit.federation.archive import ARCHIVE, PACKED_SWEEP_RECORD
from pflkit.federation.packing import results_folders
from pflkit.reporting import summarize
from tests.support.paths import REPO

ROOT = REPO / "docs" / "results"


def listed() -> dict[str, str]:
    """SHA256SUMS: path relative to docs/results -> sha256. A file's line is what ``sha256sum``
    prints for it; a cell's line (its path ends in ``/``) holds the sha256 of what ``sha256sum``
    prints for the cell's files in name order (``LC_ALL=C sha256sum * | sha256sum`` in the
    unpacked cell)."""
    out = {}
    for line in (ROOT / "SHA256SUMS").read_text().splitlines():
        digest, path = line.split("  ", 1)
        out[path] = digest
    return out


def cell_digest(files: dict[str, bytes]) -> str:
    """A cell's line in SHA256SUMS: the sha256 of its files' ``sha256sum`` lines in name order."""
    lines = "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def present() -> dict[str, bytes | dict[str, bytes]]:
    """Everything under docs/results as it was before packing, by path relative to docs/results:
    each packed cell (``<table>/<cell>/``) as its files, packed sweep records and plain files as
    their bytes."""
    out: dict[str, bytes | dict[str, bytes]] = {}
    for path in sorted(ROOT.rglob("*")):
        if not path.is_file() or path.name == "SHA256SUMS":
            continue
        rel = path.relative_to(ROOT)
        if path.name == ARCHIVE:
            members = ResultsFolder(path.parent).archived()
            out[f"{rel.parent}/"] = {name: data for name, (data, _) in members.items()}
        elif path.name == PACKED_SWEEP_RECORD:
            out[str(rel.parent / "sweep.json")] = lzma.decompress(path.read_bytes())
        else:
            out[str(rel)] = path.read_bytes()
    return out


def digest(found: bytes | dict[str, bytes]) -> str:
    return hashlib.sha256(found).hexdigest() if isinstance(found, bytes) else cell_digest(found)


def test_every_committed_cell_and_result_file_is_there_byte_for_byte() -> None:
    sums, found = listed(), present()
    missing = sorted(set(sums) - set(found))
    assert not missing, f"cells or files listed in SHA256SUMS but lost: {missing[:5]}"
    changed = sorted(p for p in sums if digest(found[p]) != sums[p])
    assert not changed, f"cells or files that differ from SHA256SUMS: {changed[:5]}"
    unlisted = sorted(set(found) - set(sums))
    assert not unlisted, f"cells or result files that SHA256SUMS does not list (add their lines): {unlisted[:5]}"


def test_a_cells_digest_is_the_sha256_of_its_files_sha256sum_lines() -> None:
    # what `LC_ALL=C sha256sum * | sha256sum` prints in a folder holding these two files
    files = {"run.json": b"{}\n", "metrics.jsonl": b""}
    assert cell_digest(files) == "2110987f36d91d85b113a71f6216a07bb072ff421f39318c0a65f50a0a3e2cca"


def committed_cells() -> list[Path]:
    """The results folders under docs/results (not the sweep folders above them)."""
    found = results_folders(ROOT)
    return [c for c in found if (c / ARCHIVE).is_file() or (c / "run.json").is_file()]


def same(a: Any, b: Any) -> bool:
    """Equal numbers and tables; floats to 12 digits (seconds summed in another order differ in
    the last bit)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12)
    return bool(a == b)


def test_each_cells_summary_is_what_its_records_give() -> None:
    cells = committed_cells()
    assert len(cells) > 250
    for cell in cells:
        results = ResultsFolder(cell)
        status = results.status()
        if status["status"] == "failed":  # a diverged run, kept as a result: its error, no summary
            assert status.get("error") and not results.has_summary(), cell
            continue
        assert status["status"] == "complete", cell
        summary, histories = results.summary(), results.histories()
        for method, entry in summary.items():
            seeds = sorted(int(s) for s in entry["seeds"])
            recomputed = summarize(histories, [method], seeds)[method]
            differing = [k for k, v in recomputed.items() if not same(v, entry.get(k))]
            assert not differing, f"{cell}: summary.json's {differing[:3]} of {method} differ from its records"


def test_every_cell_holds_its_config_in_its_archive_and_reruns_from_it() -> None:
    """``pflkit run <cell>/config.toml`` reruns a committed cell: the config is read from its
    records.tar.xz."""
    cells = committed_cells()
    plain = [cell for cell in cells if (cell / "config.toml").exists()]
    assert not plain, f"cells whose config.toml is not packed (pflkit pack them): {plain[:3]}"
    assert all(ResultsFolder(cell).has_config() for cell in cells)
    for table in sorted({cell.parent for cell in cells}):
        cell = min(c for c in cells if c.parent == table)
        assert load_cli_config(str(cell / "config.toml"), []) == ResultsFolder(cell).load_config()


#: docs/results/ stays under this many bytes (the sum of its files' sizes)
SIZE_LIMIT = 8_000_000


def test_the_committed_cells_stay_under_their_size_limit() -> None:
    size = sum(path.stat().st_size for path in ROOT.rglob("*") if path.is_file())
    assert size < SIZE_LIMIT, (
        f"docs/results/ holds {size:,} bytes, {size - SIZE_LIMIT + 1:,} too many for its limit of "
        f"{SIZE_LIMIT:,}: pack new cells (pflkit pack docs/results) or commit fewer"
    )
    print(f"docs/results/: {size:,} bytes, {SIZE_LIMIT - size:,} left under the limit of {SIZE_LIMIT:,}")

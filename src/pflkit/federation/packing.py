"""Packing results folders (``pflkit pack`` / ``pflkit unpack``).

``pack`` moves every plain file at the top level of a complete results folder (config.toml,
run.json, metrics.jsonl, summary.json, partition-seed<k>.json, ...) into one ``records.tar.xz``,
byte for byte: the archive is written under a temporary name, read back and compared, and only
then takes its name and the plain files go. A folder packed while config.toml stayed plain (an earlier
pflkit left it out) has it moved into the archive by the next pack. ``unpack`` writes them back (same bytes, same
modification times) and removes the archive. Subfolders (checkpoints/, plots/, states/, trace/)
are left where they are, untouched. Both hold the folder's lock: a folder a run is writing is
refused, and so is a folder whose run is not complete. A sweep folder's sweep.json (the record of
every cell, read by reports) packs as sweep.json.xz; its sweep.md stays plain."""

from __future__ import annotations

import lzma
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .archive import ARCHIVE, PACKED_SWEEP_RECORD, SWEEP_RECORD, read_archive, write_archive, xz
from .results import (
    CONFIG_FILE,
    LOCK_FILE,
    RUN_FILE,
    FolderBusyError,
    ResultsFolder,
    folder_lock,
    parse_json_object,
)

#: what stays a plain file in a packed folder: only the lock, which is no record
KEPT = frozenset({LOCK_FILE})
_PARTIAL = ARCHIVE + ".tmp"


class PackError(ValueError):
    """A folder that cannot be packed or unpacked, with the reason."""


def results_folders(top: Path, packed: bool = False) -> Iterator[Path]:
    """The results folders and sweep folders at or below ``top`` (with ``packed``: the packed
    ones), sorted; never below a results folder (its checkpoints/ and plots/ are no folders of their
    own)."""
    for folder, subfolders, files in os.walk(top):
        names = set(files)
        subfolders.sort()
        if ARCHIVE in names or (not packed and names & {CONFIG_FILE, RUN_FILE}):
            subfolders.clear()
            yield Path(folder)
        elif PACKED_SWEEP_RECORD in names or (not packed and SWEEP_RECORD in names):
            yield Path(folder)


def _is_results_folder(folder: Path) -> bool:
    return any((folder / name).is_file() for name in (CONFIG_FILE, RUN_FILE, ARCHIVE))


def has_sweep_record(folder: Path) -> bool:
    """Whether ``folder`` is a sweep folder: it holds sweep.json, plain or packed."""
    return (folder / SWEEP_RECORD).is_file() or (folder / PACKED_SWEEP_RECORD).is_file()


def read_sweep_record(folder: Path) -> dict[str, Any]:
    """A sweep folder's sweep.json (plain, or else packed), or an error naming the file."""
    plain, packed = folder / SWEEP_RECORD, folder / PACKED_SWEEP_RECORD
    if plain.is_file() or not packed.is_file():
        return parse_json_object(plain.read_bytes(), str(plain))
    try:
        content = lzma.decompress(packed.read_bytes())
    except lzma.LZMAError as exc:
        raise ValueError(f"{packed} is not readable xz ({exc})") from None
    return parse_json_object(content, str(packed))


def _records(folder: Path) -> dict[str, Path]:
    """The top-level files of ``folder`` an archive holds, by name (links refused)."""
    out = {}
    for path in sorted(folder.iterdir()):
        if path.name in KEPT or path.name in (ARCHIVE, _PARTIAL) or (path.is_dir() and not path.is_symlink()):
            continue
        if path.is_symlink() or not path.is_file():
            raise PackError(f"{path} is not a plain file (a link or a device): move it away first")
        out[path.name] = path
    return out


def _fsynced(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextmanager
def _held(folder: Path) -> Iterator[None]:
    """Hold the folder's lock (a folder a run writes is refused, one line), then remove the lock
    file while still holding it: it is no record (a run creates it again when it needs it)."""
    try:
        with folder_lock(folder):
            try:
                yield
            finally:
                (folder / LOCK_FILE).unlink(missing_ok=True)
    except FolderBusyError as exc:
        raise PackError(str(exc)) from None


def pack_folder(folder: Path) -> str:
    """Pack one ended results folder (complete, or failed with its error: a run that stopped on a NaN
    loss is a result too), or a sweep folder's sweep.json; the line that says what was done.
    PackError with the reason where it is not packed: running, interrupted, or not a pflkit run."""
    if not _is_results_folder(folder):
        return _pack_sweep_record(folder)
    results = ResultsFolder(folder)
    with _held(folder):
        try:
            status = results.status()
        except (OSError, RuntimeError, ValueError) as exc:
            raise PackError(str(exc)) from None
        ended = (status["status"] == "complete" and results.has_summary()) or (
            status["status"] == "failed" and bool(status.get("error"))
        )
        if not ended:
            raise PackError(
                f"{folder}: its run is {status['status']}, neither complete nor failed (only ended runs are "
                "packed; continue it with pflkit run --resume first)"
            )
        records = _records(folder)
        files = {name: (path.read_bytes(), int(path.stat().st_mtime)) for name, path in records.items()}
        added: dict[str, tuple[bytes, int]] = {}
        if results.packed:
            members = results.archived()
            _drop_copies(results, {name: path for name, path in records.items() if name in members})
            added = {name: files[name] for name in files if name not in members}
            if not added:
                return f"{folder}: already packed"
            files = {**members, **added}  # a file left out of the archive (config.toml, packed earlier) goes in
            records = {name: records[name] for name in added}
        partial = folder / _PARTIAL
        write_archive(partial, files)
        _fsynced(partial)
        if read_archive(partial) != files:
            partial.unlink()
            raise PackError(f"{folder}: the archive did not read back as the files it was written from")
        os.replace(partial, results.archive_path)
        for path in records.values():
            path.unlink()
    before, after = sum(len(data) for data, _ in files.values()), results.archive_path.stat().st_size
    if added:
        return f"{folder}: moved {', '.join(sorted(added))} into {ARCHIVE} (now {after} bytes)"
    return f"{folder}: packed {len(files)} files ({before} bytes) into {ARCHIVE} ({after} bytes)"


def _drop_copies(results: ResultsFolder, records: dict[str, Path]) -> None:
    """Remove plain files a packed folder still holds where they equal the archive's copies (a pack
    stopped between renaming the archive and removing them); refuse any other."""
    members = results.archived()
    for name, path in records.items():
        if name not in members or members[name][0] != path.read_bytes():
            raise PackError(
                f"{results.root} is packed but also holds {name}, which is not the copy in its "
                f"{ARCHIVE}: unpack it (pflkit unpack) and compare, or move {name} away"
            )
    for path in records.values():
        path.unlink()


def unpack_folder(folder: Path) -> str:
    """Restore the plain files of one packed folder and remove its archive; the line that says
    what was done. PackError where a plain file there differs from the archive's copy."""
    if not _is_results_folder(folder):
        return _unpack_sweep_record(folder)
    results = ResultsFolder(folder)
    if not results.packed:
        return f"{folder}: not packed"
    with _held(folder):
        try:
            members = read_archive(results.archive_path)
        except ValueError as exc:  # a damaged archive
            raise PackError(str(exc)) from None
        for name, (data, _) in members.items():
            if (folder / name).is_file() and (folder / name).read_bytes() != data:
                raise PackError(f"{folder / name} differs from its copy in {results.archive_path}: move one away")
        for name, (data, mtime) in members.items():
            partial = folder / (name + ".tmp")
            partial.write_bytes(data)
            _fsynced(partial)
            os.utime(partial, (mtime, mtime))
            os.replace(partial, folder / name)
        results.archive_path.unlink()
    return f"{folder}: unpacked {len(members)} files"


def _pack_sweep_record(folder: Path) -> str:
    """sweep.json -> sweep.json.xz (a sweep that ran since wrote a newer sweep.json: it replaces
    the packed one)."""
    plain, packed = folder / SWEEP_RECORD, folder / PACKED_SWEEP_RECORD
    with _held(folder):
        if not plain.is_file():
            return f"{folder}: {SWEEP_RECORD} already packed" if packed.is_file() else f"{folder}: no {SWEEP_RECORD}"
        data, mtime = plain.read_bytes(), plain.stat().st_mtime
        partial = folder / (PACKED_SWEEP_RECORD + ".tmp")
        partial.write_bytes(xz(data))
        _fsynced(partial)
        if lzma.decompress(partial.read_bytes()) != data:
            partial.unlink()
            raise PackError(f"{folder}: {PACKED_SWEEP_RECORD} did not read back as {SWEEP_RECORD}")
        os.utime(partial, (mtime, mtime))
        os.replace(partial, packed)
        plain.unlink()
    after = packed.stat().st_size
    return f"{folder}: packed {SWEEP_RECORD} ({len(data)} bytes) into {PACKED_SWEEP_RECORD} ({after} bytes)"


def _unpack_sweep_record(folder: Path) -> str:
    plain, packed = folder / SWEEP_RECORD, folder / PACKED_SWEEP_RECORD
    if not packed.is_file():
        return f"{folder}: not packed"
    with _held(folder):
        try:
            data = lzma.decompress(packed.read_bytes())
        except lzma.LZMAError as exc:
            raise PackError(f"{packed} is not readable xz ({exc})") from None
        if plain.is_file() and plain.read_bytes() != data:
            raise PackError(f"{plain} differs from its copy in {packed}: move one away")
        mtime = packed.stat().st_mtime
        partial = folder / (SWEEP_RECORD + ".tmp")
        partial.write_bytes(data)
        _fsynced(partial)
        os.utime(partial, (mtime, mtime))
        os.replace(partial, plain)
        packed.unlink()
    return f"{folder}: unpacked {SWEEP_RECORD}"

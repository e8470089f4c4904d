"""``pflkit pack`` and ``pflkit unpack``: results folders as one archive each, and back."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import click

from .app import main
from .common import USER_ERRORS, fail

FOLDERS = click.argument(
    "folders", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path)
)


def _each(folders: tuple[Path, ...], packed: bool, act: Callable[[Path], str]) -> None:
    """``act`` on every results folder at or below each of ``folders``: one line per folder; the
    refused ones on stderr, and then exit status 2."""
    from ..federation.packing import PackError, results_folders

    try:
        found = [f for top in folders for f in results_folders(top, packed)]
    except USER_ERRORS as exc:
        fail(exc)
    if not found:
        fail(ValueError(f"no {'packed ' if packed else ''}results folder at or below {', '.join(map(str, folders))}"))
    refused = 0
    for folder in dict.fromkeys(found):
        try:
            click.echo(act(folder))
        except PackError as exc:
            refused += 1
            click.echo(f"refused: {exc}", err=True)
    if refused:
        click.echo(f"{refused} of {len(found)} folders refused (see above)", err=True)
        sys.exit(2)


@main.command(
    epilog="\b\nExamples:\n  pflkit pack docs/results                 # every ended cell below it\n"
    "  pflkit pack results/quick results/sweep"
)
@FOLDERS
def pack(folders: tuple[Path, ...]) -> None:
    """Pack every ended results folder at or below FOLDERS (complete, or failed with its error, as a
    run stopped by a NaN loss): every file of the folder's top
    level, config.toml included, goes byte for byte into records.tar.xz (checked by reading it
    back); subfolders (checkpoints/, plots/) stay as they are. Every reader of pflkit reads a packed
    folder as the plain one (pflkit run FOLDER/config.toml reads the config from the archive); a run
    never writes into it. Running or interrupted folders are refused."""
    from ..federation.packing import pack_folder

    _each(folders, False, pack_folder)


@main.command(
    epilog="\b\nExample:\n  pflkit unpack results/quick\n"
    "  pflkit run --resume results/quick        # continue it, now that it is plain"
)
@FOLDERS
def unpack(folders: tuple[Path, ...]) -> None:
    """Restore the plain files of every packed results folder at or below FOLDERS, byte for byte
    (with their modification times), and remove its records.tar.xz."""
    from ..federation.packing import unpack_folder

    _each(folders, True, unpack_folder)

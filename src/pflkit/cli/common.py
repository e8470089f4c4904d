"""What every command shares: splitting CONFIG from overrides, and how errors and stops end a command."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from ..config import BaseConfig
    from ..federation import ResultsFolder

_OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*=")


def _split(args: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """One CONFIG.toml and key=value overrides; a path whose folder names hold ``=`` (a sweep
    cell's ``results/sp/fedala.p=2/config.toml``, plain or packed) is the config, not an override."""
    config = None
    overrides = []
    for arg in args:
        if _OVERRIDE.match(arg) and not (arg.endswith(".toml") and (Path(arg).is_file() or _packed_config(arg))):
            overrides.append(arg)
        elif config is None:
            config = arg
        else:
            raise click.UsageError(f"unexpected argument {arg!r}: give one CONFIG.toml and key=value overrides")
    return config, overrides


def _packed_config(path: str) -> ResultsFolder | None:
    """The packed results folder whose config.toml ``path`` names, or None:
    ``pflkit pack`` moved that file into the folder's records.tar.xz."""
    from ..federation.results import CONFIG_FILE, ResultsFolder

    target = Path(path)
    if target.name != CONFIG_FILE or target.exists():
        return None
    results = ResultsFolder(target.parent)
    try:
        return results if results.packed and results.has_config() else None
    except ValueError:  # a damaged archive: reading the config names it
        return results


def load_cli_config(path: str | None, overrides: Sequence[str]) -> BaseConfig:
    """The config of CONFIG.toml and overrides; ``<folder>/config.toml`` of a packed results folder
    is read from its archive, so ``pflkit run <folder>/config.toml`` reruns a packed cell too."""
    from ..config import load_config

    results = _packed_config(path) if path is not None else None
    if results is None:
        return load_config(path, overrides)
    return load_config(path, overrides, data=results.config_table())


# What bad input raises (configs, data files, partitions, NaN losses, folders): reported as one
# "error: ..." line and exit status 2; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, RuntimeError, OSError, FloatingPointError)


def check_writable_file(path: Path) -> None:
    """OSError naming ``path`` unless a file can be written there (checked before any work)."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: give a file name for the report")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist: create it first, or write the report elsewhere")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PermissionError(f"{path} cannot be written (no permission)")


def check_writable_folder(path: Path) -> None:
    """OSError naming ``path`` unless it is, or can become, a folder this process writes into
    (checked before any work: a run or a sweep must not fail there after minutes)."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file, not a folder: choose another --out")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(f"{existing} is a file: {path} cannot be a folder below it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{path} cannot be written: no permission in {existing}")


def fail(exc: BaseException) -> None:
    if click.get_current_context().find_root().params.get("debug"):
        raise exc
    click.echo(f"error: {exc}", err=True)
    sys.exit(2)


def interrupted(exc: KeyboardInterrupt, resume: str) -> None:
    reason = str(exc) or "interrupted (Ctrl-C)"
    click.echo(f"\n{reason}: the rounds up to the last checkpoint are kept; continue with: {resume}", err=True)
    sys.exit(130)

"""Atomic, verified file downloads shared by every dataset downloader.

A download goes to a hidden temporary file next to its destination, is checked
(md5 or a format check), and only then renamed into place, so an interrupted or
corrupt transfer never leaves a file under the final name.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from pflkit.data.errors import DataError

__all__ = ["check_present", "fetch", "md5sum", "md5_check"]


def md5sum(path: Path) -> str:
    """The md5 hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.md5()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def md5_check(expected: str) -> Callable[[Path], None]:
    """A verifier for :func:`fetch` that requires the official md5 sum ``expected``."""

    def verify(path: Path) -> None:
        actual = md5sum(path)
        if actual != expected:
            raise DataError(f"md5 {actual} does not match the official {expected}")

    return verify


def fetch(urls: Sequence[str], dest: Path, verify: Callable[[Path], None], timeout: float = 60) -> Path:
    """Download the first of ``urls`` that works and passes ``verify`` to ``dest``; return ``dest``.

    ``verify`` gets the temporary file and raises :class:`DataError` (or ``OSError``)
    when the content is wrong; the next mirror is then tried.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for url in urls:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
                for chunk in iter(lambda: response.read(1 << 20), b""):
                    out.write(chunk)
            verify(tmp)
            os.replace(tmp, dest)
            return dest
        except (urllib.error.URLError, OSError, DataError) as exc:
            errors.append(f"{url}: {exc}")
        finally:
            tmp.unlink(missing_ok=True)
    raise DataError(f"could not download {dest.name} into {dest.parent}; tried " + "; ".join(errors))


def check_present(path: Path, verify: Callable[[Path], None]) -> None:
    """A file already in place is checked as a download would be; DataError naming it if it fails
    (a partial or foreign file is never reported ready)."""
    try:
        verify(path)
    except (DataError, OSError, ValueError) as exc:
        raise DataError(
            f"{path} is already there but is not the expected file ({exc}): delete it and run pflkit download again"
        ) from None

"""The archive of a packed results folder: ``records.tar.xz``, a tar of plain files (no folders,
no links) compressed with xz at its strongest setting, written the same way every time (members
sorted by name, owner root, mode 644, each file's own modification time). A sweep folder's
``sweep.json`` packs alone, as ``sweep.json.xz``."""

from __future__ import annotations

import io
import lzma
import tarfile
from collections.abc import Mapping
from pathlib import Path

ARCHIVE = "records.tar.xz"
SWEEP_RECORD = "sweep.json"
PACKED_SWEEP_RECORD = SWEEP_RECORD + ".xz"

#: xz -9e; the dictionary never larger than the tar itself (the same compression, a fraction of
#: the memory)
_PRESET = 9 | lzma.PRESET_EXTREME


def write_archive(path: Path, files: Mapping[str, tuple[bytes, int]]) -> None:
    """Write ``files`` (name -> (content, modification time in seconds)) as an archive at ``path``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):
            data, mtime = files[name]
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(xz(buffer.getvalue()))


def xz(data: bytes) -> bytes:
    """``data`` as ``xz -9e`` compresses it (``xz -d`` or ``lzma.decompress`` reads it back)."""
    dict_size = max(1 << 16, min(1 << 26, 1 << max(len(data) - 1, 1).bit_length()))
    filters = [{"id": lzma.FILTER_LZMA2, "preset": _PRESET, "dict_size": dict_size}]
    return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters)


def read_archive(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every member of the archive at ``path`` (name -> (content, modification time)); an error
    naming the file where it is damaged or holds anything but plain files at its top level."""
    try:
        raw = lzma.decompress(path.read_bytes())
        members: dict[str, tuple[bytes, int]] = {}
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for info in tar:
                if not info.isfile() or "/" in info.name or info.name in ("", ".", "..") or info.name in members:
                    raise ValueError(f"it holds {info.name!r}, which is not one plain file of a results folder")
                extracted = tar.extractfile(info)
                assert extracted is not None  # a regular file always has content
                members[info.name] = (extracted.read(), int(info.mtime))
    except (lzma.LZMAError, tarfile.TarError, EOFError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable records archive ({exc})") from None
    return members

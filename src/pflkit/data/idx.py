"""Reader and writer for the IDX file format used by MNIST.

An IDX file is: two zero bytes, one type-code byte, one byte holding the number
of dimensions, the dimensions as big-endian uint32, then the values in C order
(big-endian for multi-byte types). Files are often gzip-compressed; compression
is detected from the content, not from the file name.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np

from pflkit.data.errors import DataError

__all__ = ["read_idx", "write_idx"]

_GZIP_MAGIC = b"\x1f\x8b"

# Type code -> big-endian dtype as stored in the file.
_CODE_TO_DTYPE: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_KIND_SIZE_TO_CODE: dict[tuple[str, int], int] = {(dt.kind, dt.itemsize): code for code, dt in _CODE_TO_DTYPE.items()}


def _decompress(raw: bytes, path: Path) -> bytes:
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: broken gzip stream ({exc}); re-download or re-extract the file") from exc


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (plain or gzip-compressed) into a native-endian array.

    Raises :class:`DataError` when the file is missing, the gzip stream is broken,
    the header is invalid, or the payload size does not match the dimensions.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read IDX file ({exc})") from exc
    if raw[:2] == _GZIP_MAGIC:
        raw = _decompress(raw, path)

    if len(raw) < 4:
        raise DataError(f"{path}: too short for an IDX header ({len(raw)} bytes, need at least 4)")
    if raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path}: bad IDX magic: expected the first two bytes to be 00 00, got {raw[:2].hex(' ')}")
    code, ndim = raw[2], raw[3]
    if code not in _CODE_TO_DTYPE:
        known = ", ".join(f"0x{c:02X}" for c in _CODE_TO_DTYPE)
        raise DataError(f"{path}: unknown IDX type code 0x{code:02X} (known: {known})")
    if ndim == 0:
        raise DataError(f"{path}: IDX header declares 0 dimensions; expected at least 1")
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataError(
            f"{path}: truncated IDX header: {ndim} dimensions need {header_size} header bytes, file has {len(raw)}"
        )
    dims = struct.unpack(f">{ndim}I", raw[4:header_size])
    dtype = _CODE_TO_DTYPE[code]
    expected = math.prod(dims) * dtype.itemsize
    actual = len(raw) - header_size
    if actual != expected:
        problem = "truncated" if actual < expected else "trailing bytes after data"
        raise DataError(
            f"{path}: IDX payload size mismatch ({problem}): dimensions {tuple(dims)} of "
            f"{dtype.itemsize}-byte values need {expected} bytes, found {actual}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header_size).reshape(dims)
    # astype always copies, which also makes the result writable and native-endian.
    return data.astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray, compress: bool | None = None) -> None:
    """Write ``array`` as an IDX file, gzip-compressed if requested.

    ``compress=None`` compresses exactly when the file name ends with ``.gz``.
    Supported dtypes: uint8, int8, int16, int32, float32, float64.
    """
    path = Path(path)
    array = np.asarray(array)
    code = _KIND_SIZE_TO_CODE.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise ValueError(
            f"write_idx: dtype {array.dtype} has no IDX type code; use uint8, int8, int16, int32, float32 or float64"
        )
    if not 1 <= array.ndim <= 255:
        raise ValueError(f"write_idx: IDX needs 1 to 255 dimensions, array has {array.ndim}")
    if any(d >= 2**32 for d in array.shape):
        raise ValueError(f"write_idx: dimension sizes must fit in uint32, got shape {array.shape}")
    if compress is None:
        compress = path.name.endswith(".gz")

    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + np.ascontiguousarray(array, dtype=_CODE_TO_DTYPE[code]).tobytes()
    if compress:
        # mtime=0 keeps the output byte-identical across runs.
        payload = gzip.compress(payload, mtime=0)
    path.write_bytes(payload)

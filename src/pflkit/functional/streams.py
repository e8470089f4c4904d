"""Seeded random streams keyed by (seed, round, client, purpose).

Every engine draws batch orders, samples and client selections from these streams, so the
sequential, parallel and resumed paths see identical randomness without saving RNG state.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch


def stream_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed derived from the run seed and any keys (ints or strings)."""
    words = [int(seed)] + [zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in keys]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def torch_generator(seed: int, *keys: int | str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(stream_seed(seed, *keys))
    return g


def numpy_generator(seed: int, *keys: int | str) -> np.random.Generator:
    return np.random.default_rng(stream_seed(seed, *keys))

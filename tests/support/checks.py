"""Comparisons the tests share: parameter dicts, server and client states, whole runs."""

from __future__ import annotations

import torch

#: the tolerance of a comparison with a reference transcription in float32 (same operations, same order)
RTOL, ATOL = 1e-5, 1e-6


def assert_params_close(a, b, rtol=RTOL, atol=ATOL):
    """The same keys, and every tensor within rtol / atol."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


def assert_expected_close(actual: dict, expected: dict, keys=None) -> None:
    """Every tensor of ``expected`` (or only ``keys``) within RTOL / ATOL of ``actual``'s."""
    for k in expected if keys is None else keys:
        torch.testing.assert_close(actual[k], expected[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


def moved(a: dict, b: dict) -> bool:
    """Some tensor differs by more than 1e-4."""
    return any(not torch.allclose(a[k], b[k], rtol=0, atol=1e-4) for k in a)


def differs(a, b) -> bool:
    """Some tensor is not allclose."""
    return any(not torch.allclose(a[k], b[k]) for k in a)


def assert_states_close(a, b, atol: float) -> None:
    """Server and client states equal within ``atol`` (0: bit-identical)."""

    def walk(x, y, path):
        if isinstance(x, dict):
            assert x.keys() == y.keys(), path
            for k in x:
                walk(x[k], y[k], f"{path}.{k}")
        elif isinstance(x, torch.Tensor):
            if atol == 0:
                assert torch.equal(x, y), path
            else:
                torch.testing.assert_close(x, y, rtol=1e-3, atol=atol, msg=path)
        else:
            assert x == y, path

    walk(a.server, b.server, "server")
    walk(a.clients, b.clients, "clients")


def assert_same_state(a, b):
    """Bit-identical states and identical metrics (wall-clock fields aside)."""
    assert_states_close(a, b, atol=0.0)
    strip = lambda h: [{k: v for k, v in r.items() if "seconds" not in k} for r in h]  # noqa: E731
    assert strip(a.history) == strip(b.history)

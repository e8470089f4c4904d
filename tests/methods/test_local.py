"""Local training (docs/reference/methods/local.md): no communication, plain SGD recomputed by
hand."""

from __future__ import annotations

import pytest
import torch

from tests.support.builders import build, params_of, summaries, tiny_context
from tests.support.references import sgd_reference


def test_local_training_never_communicates():
    ctx = tiny_context()
    init = params_of(ctx, 1)
    alg = build("local", ctx)
    server = alg.prepare(alg.init_server(init), summaries([10] * 1))
    assert alg.downlink(server, 0, 1) == {}
    state, _ = alg.local_init({}, alg.init_client(init, 0), ctx)
    torch.testing.assert_close(state["model"], init)
    new, upload, _ = alg.local_train({}, state, ctx)
    expected = sgd_reference(ctx, init, "train", 1)
    torch.testing.assert_close(new["model"], expected)
    assert upload["params"] == {} and alg.aggregate(server, [upload], 1) is server
    with pytest.raises(ValueError, match="ALA"):
        build("local+ala", ctx)

"""Partners of the two SosicFL+ strict xfails in ``tests/test_reference_global.py``: the same
transcription of floco's Floco+ client (dennis-grinwald/floco a25b3a1) with the difference
docs/algorithms.md records applied asserts equality with pflkit, so that a third behaviour fails.

Recorded differences: floco's _regularize_pers_model adds lamda * p - global to the gradient
(operator precedence), pflkit's lam/2 ||p - global||^2 adds lam * (p - global); floco scores the
personal endpoints at the simplex centroid, pflkit at the client's cluster centre."""

from __future__ import annotations

import pytest
import torch

from helpers import batch_pairs, params_of
from test_reference_global import FlocoModel, close, floco_optimizer, floco_training_loop, sosicfl_setup


@pytest.mark.parametrize("lam", [0.5, 2.0])
def test_sosicfl_plus_regulariser_is_flocos_with_lambda_times_the_gap(lam):
    """Partner of ``test_sosicfl_plus_regulariser_at_lambda_one_half_as_flocos_code``: floco's
    loop given the anchor lam * global adds lam * p - lam * global = lam * (p - global)."""
    ctxs, alg, server = sosicfl_setup("sosicfl_plus", f"sosicfl.plus_lam={lam}")
    ctx = ctxs[0]
    payload = alg.downlink(server, 0, 1)
    state = alg.init_client(params_of(ctx, 8), 0)
    state = {**state, "personal": {k: v + 0.05 for k, v in state["personal"].items()}}  # last round's personal
    start = dict(state["personal"])
    state, _ = alg.local_init(payload, state, ctx)
    new, _, _ = alg.local_train(payload, state, ctx)
    pers = FlocoModel(ctx, start, alg.M1)
    anchor = {k: lam * v for k, v in payload["global"].items()}
    floco_training_loop(pers, batch_pairs(ctx, "personal", 1), payload["personal_alphas"], floco_optimizer(pers, ctx),
                        anchor=anchor, lamda=lam)
    close(new["personal"], pers.as_dict())
    # floco's literal term (the xfail) ends elsewhere
    literal = FlocoModel(ctx, start, alg.M1)
    floco_training_loop(literal, batch_pairs(ctx, "personal", 1), payload["personal_alphas"],
                        floco_optimizer(literal, ctx), anchor=payload["global"], lamda=lam)
    assert max(float((literal.as_dict()[k] - new["personal"][k]).abs().max()) for k in new["personal"]) > 1e-4


def test_sosicfl_plus_scores_the_personal_endpoints_at_the_cluster_centre():
    """Partner of ``test_sosicfl_plus_scores_the_personal_endpoints_at_the_centroid_as_flocos_code``:
    floco's personal model evaluated with the client's cluster centre as its alphas."""
    ctxs, alg, server = sosicfl_setup("sosicfl_plus")
    ctx = ctxs[0]
    payload = alg.downlink(server, 0, 1)
    state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 8), 0), ctx)
    centre = payload["center"]
    assert float((centre - 1.0 / alg.M1).abs().max()) > 1e-2  # not the centroid
    pers = FlocoModel(ctx, state["personal"], alg.M1)
    pers.eval()
    pers.classifier.alphas = [float(a) for a in centre]
    x = ctx.data.test_x
    with torch.no_grad():
        theirs = pers(x)
    ours = ctx.net(alg.eval_params(state), x, train=False)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)

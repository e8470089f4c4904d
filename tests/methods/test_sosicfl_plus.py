"""SosicFL+: post-hoc personalisation, and the client round against my transcription of floco's
Floco+ client (dennis-grinwald/floco a25b3a1, ``src/client/floco.py``: training_loop,
_regularize_pers_model; the transcription is in tests/support/references.py).

Two strict xfails state floco's behaviour where pflkit differs; their partners apply the
difference the method's card records to the same transcription and assert equality with pflkit,
so that a third behaviour fails. Recorded differences: floco's _regularize_pers_model adds
lamda * p - global to the gradient (operator precedence), pflkit's lam/2 ||p - global||^2 adds
lam * (p - global); floco scores the personal endpoints at the simplex centroid, pflkit at the
client's cluster centre."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pflkit.config import load_config
from pflkit.methods import build_algorithm
from tests.support.builders import batch_pairs, params_of, sosicfl_setup, tiny_context
from tests.support.checks import ATOL, RTOL, assert_expected_close
from tests.support.references import XFAIL_DIFFERS, FlocoModel, floco_optimizer, floco_training_loop


def test_sosicfl_plus_post_hoc_personalises_every_client_from_the_final_global_endpoints() -> None:
    """plus_mode = post_hoc ("applying Ditto after SosicFL training"): no personal training during
    the rounds, where a client is scored with the global endpoints at its centre; in the final
    evaluation pass every client fine-tunes personal endpoints starting from the final global ones."""
    from pflkit.algorithms import ClientSummary

    config = load_config(
        None, ["sosicfl.num_clusters=2", "sosicfl.pool_size=50", "sosicfl.n_init=1", "sosicfl.plus_mode='post_hoc'"]
    )
    last = tiny_context(round=1)  # TrainSettings.rounds = 1: round 1 trains, round 2 is the final pass
    alg = build_algorithm("sosicfl_plus", config.algorithm_sections(), last.train, last.units)
    counts = [np.array([30, 30, 5, 5, 0, 0, 0, 0, 0, 0])] * 2 + [np.array([0, 0, 0, 0, 0, 0, 5, 5, 30, 30])] * 2
    server = alg.prepare(alg.init_server(params_of(last, 0)), [ClientSummary(i, 70, c) for i, c in enumerate(counts)])
    state = alg.init_client(params_of(last, 0), 0)
    state["personal"] = {k: v + 1.0 for k, v in state["personal"].items()}  # anything but the global endpoints
    payload = alg.downlink(server, 0, 1)
    state, info = alg.local_init(payload, state, last)
    assert "personal_loss" not in info
    assert all(torch.equal(state["personal"][k], payload["global"][k]) for k in payload["global"])
    trained, _, metrics = alg.local_train(payload, state, last)
    assert "personal_loss" not in metrics  # no personal training in the rounds, not even the last
    assert all(torch.equal(trained["personal"][k], payload["global"][k]) for k in payload["global"])
    # the final pass: personal endpoints fine-tuned from the final global ones (a new download)
    final = {**payload, "global": {k: v + 0.5 for k, v in payload["global"].items()}}
    final_ctx = tiny_context(round=2)
    state, info = alg.local_init(final, trained, final_ctx)
    assert "personal_loss" in info
    expected, _ = alg.personalise(final, {**trained, "personal": dict(final["global"])}, final_ctx)
    for k in state["personal"]:
        torch.testing.assert_close(state["personal"][k], expected["personal"][k])
    assert any(not torch.equal(state["personal"][k], final["global"][k]) for k in final["global"])


# ============================================================================ against floco's Floco+


def sosicfl_plus_round(lam: float):
    ctxs, alg, server = sosicfl_setup("sosicfl_plus", f"sosicfl.plus_lam={lam}")
    ctx = ctxs[0]
    payload = alg.downlink(server, 0, 1)
    state = alg.init_client(params_of(ctx, 8), 0)
    state = {**state, "personal": {k: v + 0.05 for k, v in state["personal"].items()}}  # last round's personal
    personal_start = dict(state["personal"])
    state, _ = alg.local_init(payload, state, ctx)
    new, _, _ = alg.local_train(payload, state, ctx)
    # floco's client: the global simplex first, then the personal one (same optimiser settings), regularised
    # toward the received parameters; pflkit draws the personal alphas from the subregion (fed in here)
    glob_model = FlocoModel(ctx, payload["global"], alg.M1)
    floco_training_loop(glob_model, batch_pairs(ctx, "train", 1), payload["alphas"], floco_optimizer(glob_model, ctx))
    pers = FlocoModel(ctx, personal_start, alg.M1)
    floco_training_loop(
        pers,
        batch_pairs(ctx, "personal", 1),
        payload["personal_alphas"],
        floco_optimizer(pers, ctx),
        anchor=payload["global"],
        lamda=lam,
    )
    return new, glob_model.as_dict(), pers.as_dict()


def test_sosicfl_plus_matches_floco_plus_at_its_default_lambda():
    new, glob_expected, pers_expected = sosicfl_plus_round(1.0)
    assert_expected_close(new["model"], glob_expected)
    assert_expected_close(new["personal"], pers_expected)


@XFAIL_DIFFERS(
    reason="floco's _regularize_pers_model adds lamda * p - global (operator "
    "precedence); pflkit's lam/2 ||p - global||^2 adds lam * (p - global): equal only at lam = 1"
)
def test_sosicfl_plus_regulariser_at_lambda_one_half_as_flocos_code():
    new, _, pers_expected = sosicfl_plus_round(0.5)
    assert_expected_close(new["personal"], pers_expected)


@XFAIL_DIFFERS(
    reason="floco's Floco+ personal model is a deepcopy made at client construction and "
    "never receives subregion_parameters (set_parameters sets them on self.model only): it trains at "
    "uniform draws over the whole simplex and is scored at the simplex centroid; pflkit trains it at "
    "subregion draws and scores it at the client's cluster centre"
)
def test_sosicfl_plus_scores_the_personal_endpoints_at_the_centroid_as_flocos_code():
    ctxs, alg, server = sosicfl_setup("sosicfl_plus")
    ctx = ctxs[0]
    payload = alg.downlink(server, 0, 1)
    state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 8), 0), ctx)
    pers = FlocoModel(ctx, state["personal"], alg.M1)
    pers.eval()  # SimplexModel.forward in eval mode without subregion parameters: alphas = the simplex centre
    pers.classifier.alphas = [1.0 / alg.M1] * alg.M1
    x = ctx.data.test_x
    with torch.no_grad():
        theirs = pers(x)
    ours = ctx.net(alg.eval_params(state), x, train=False)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


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
    floco_training_loop(
        pers,
        batch_pairs(ctx, "personal", 1),
        payload["personal_alphas"],
        floco_optimizer(pers, ctx),
        anchor=anchor,
        lamda=lam,
    )
    assert_expected_close(new["personal"], pers.as_dict())
    # floco's literal term (the xfail) ends elsewhere
    literal = FlocoModel(ctx, start, alg.M1)
    floco_training_loop(
        literal,
        batch_pairs(ctx, "personal", 1),
        payload["personal_alphas"],
        floco_optimizer(literal, ctx),
        anchor=payload["global"],
        lamda=lam,
    )
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

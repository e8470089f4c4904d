"""FedACD and its baselines: each update rule against a computation by hand (spec §3)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms import build_algorithm
from pflkit.algorithms.creff import classifier_gradient, head_gradients
from pflkit.algorithms.fedacd import adjustment, fedacd_loss, flattening_kl, reestimate
from pflkit.algorithms.feddecorr import decorrelation
from pflkit.algorithms.fedlc import calibrated_logits
from pflkit.algorithms.fednh import spread_prototypes
from pflkit.algorithms.fednova import normaliser
from pflkit.algorithms.fedntd import not_true_kl
from pflkit.config import load_config
from pflkit.functional.training import Batch, probability_matrix, template_kl

from helpers import params_of, sgd_reference, tiny_context


def build(name: str, ctx, *overrides: str):
    return build_algorithm(name, load_config(None, list(overrides)).algorithm_sections(), ctx.train, ctx.units)


# ---- FedACD -----------------------------------------------------------------------------------
def test_probability_matrix_is_the_mean_prediction_per_true_class():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0], [0.1, 0.8, 0.1]])
    y = torch.tensor([0, 0, 1])
    sums = torch.zeros(3, 3).index_add_(0, y, probs)
    P = probability_matrix(sums, torch.bincount(y, minlength=3))
    torch.testing.assert_close(P[0], torch.tensor([0.6, 0.35, 0.05]))
    torch.testing.assert_close(P[1], torch.tensor([0.1, 0.8, 0.1]))
    torch.testing.assert_close(P[2], torch.full((3,), 1 / 3))  # absent class: uniform, never used
    assert (probability_matrix(torch.zeros(2, 2), torch.tensor([1, 1])) == 1e-8).all()  # floored


def test_fedacd_estimates_P_from_the_received_model_and_reestimates_it_every_epoch():
    ctx = tiny_context(n_train=30)
    glob = params_of(ctx, 2)
    logits = ctx.net(glob, ctx.data.train_x, train=False)
    sums = torch.zeros(10, 10).index_add_(0, ctx.data.train_y, torch.softmax(logits, -1))
    P0 = probability_matrix(sums, ctx.label_counts)
    torch.testing.assert_close(P0, probability_matrix(ctx.class_sums(glob, lambda n, p, x, y: torch.softmax(
        n(p, x, train=False), -1)), ctx.label_counts))
    carried = {"fedacd.P": P0, "fedacd.sums": sums, "fedacd.weights": ctx.label_counts.float()}
    new = reestimate(0.0)(carried)
    seen = ctx.label_counts > 0
    torch.testing.assert_close(new["fedacd.P"][seen], (sums / ctx.label_counts[:, None])[seen].clamp(min=1e-8))
    assert new["fedacd.sums"].abs().sum() == 0 and new["fedacd.weights"].abs().sum() == 0
    ema = reestimate(0.9)(carried)["fedacd.P"]
    torch.testing.assert_close(ema[seen], 0.9 * P0[seen] + 0.1 * new["fedacd.P"][seen])


def test_flattening_kl_is_eq7_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.5, 0.25, 0.25]])  # q_y = p_y, the rest flat
    expected = float((q * (q.log() - p.log())).sum())
    assert float(flattening_kl(p, p.log(), torch.tensor([0]))) == pytest.approx(expected, rel=1e-6)


def test_logit_adjustment_is_eq8_by_hand_with_missing_classes():
    P = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    counts = torch.tensor([5, 3, 0])
    shift = adjustment(P, counts, tau=1.0, eps_missing=0.01)
    assert shift[0, 1] == pytest.approx(math.log(0.3 / 0.1)) and shift[1, 0] == pytest.approx(math.log(0.1 / 0.3))
    assert shift[0, 2] == pytest.approx(math.log(0.01)) and shift[1, 2] == pytest.approx(math.log(0.01))
    assert torch.all(torch.diagonal(shift) == 0)
    z = torch.tensor([[2.0, 1.0, 0.5]])
    adjusted = z + shift[0]  # label 0
    expected = -math.log(math.exp(2.0) / (math.exp(2.0) + 3 * math.exp(1.0) + 0.01 * math.exp(0.5)))
    assert float(F.cross_entropy(adjusted, torch.tensor([0]))) == pytest.approx(expected, rel=1e-6)


def test_fedacd_loss_is_la_plus_lambda_kl_and_carries_the_batch_statistics():
    ctx = tiny_context(n_train=10)
    params = params_of(ctx, 1)
    P = torch.full((10, 10), 0.1)
    cfg = build("fedacd", ctx, "fedacd.lam=2.0").settings
    carried = {"fedacd.P": P, "fedacd.sums": torch.zeros(10, 10), "fedacd.weights": torch.zeros(10)}
    batch = Batch(ctx.data.train_x, ctx.data.train_y)
    value, out = fedacd_loss(cfg, 10)(ctx.net, {**params, **carried}, batch, {"counts": ctx.label_counts})
    logits = ctx.net(params, batch.x)
    la = F.cross_entropy(logits + adjustment(P, ctx.label_counts, 1.0, 0.01)[batch.y], batch.y)
    kl = flattening_kl(logits.softmax(-1), logits.log_softmax(-1), batch.y).mean()
    torch.testing.assert_close(value, la + 2.0 * kl)
    torch.testing.assert_close(out["fedacd.weights"], torch.bincount(batch.y, minlength=10).float())
    torch.testing.assert_close(out["fedacd.sums"].sum(1), out["fedacd.weights"])  # every row sums its samples


def test_template_score_and_softmax_aggregation():
    P = torch.tensor([[0.9, 0.1], [0.3, 0.7]])
    gamma = 0.9
    T = torch.tensor([[0.9, 0.1], [0.1, 0.9]])
    rows = (P * (P.log() - T.log())).sum(1)
    assert float(template_kl(P, torch.tensor([4, 2]), gamma)) == pytest.approx(float(rows.mean()), rel=1e-6)
    assert float(template_kl(P, torch.tensor([4, 0]), gamma)) == pytest.approx(float(rows[0]), abs=1e-7)
    ctx = tiny_context()
    server = {"global": params_of(ctx, 1)}
    a, b = params_of(ctx, 2), params_of(ctx, 3)
    uploads = [{"params": a, "num_samples": 10, "score": 0.5, "client_id": 0},
               {"params": b, "num_samples": 30, "score": 1.5, "client_id": 1}]
    for agg, weights in (("softmax_neg_score", [math.exp(-0.5), math.exp(-1.5)]), ("uniform", [1, 1]),
                         ("samples", [10, 30]), ("inverse_score", [2.0, 1 / 1.5]),
                         ("softmax_neg_score_x_n", [10 * math.exp(-0.5), 30 * math.exp(-1.5)])):
        alg = build("fedacd", ctx, f'fedacd.agg="{agg}"')
        merged = alg.aggregate(server, uploads, 1)["global"]
        wa, wb = weights[0] / sum(weights), weights[1] / sum(weights)
        for k in a:
            torch.testing.assert_close(merged[k], wa * a[k] + wb * b[k])


def test_fedacd_round_uploads_its_score():
    ctx = tiny_context(n_train=30)
    glob = params_of(ctx, 2)
    alg = build("fedacd", ctx)
    state, _ = alg.local_init({"global": glob}, alg.init_client(glob, 0), ctx)
    new, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    P = probability_matrix(ctx.class_sums(new["model"], lambda n, p, x, y: torch.softmax(n(p, x, train=False), -1)),
                           ctx.label_counts)
    assert float(upload["score"]) == pytest.approx(float(template_kl(P, ctx.label_counts, 0.9)), rel=1e-6)
    assert metrics["score"] == upload["score"]


# ---- FedNova ----------------------------------------------------------------------------------
def test_fednova_normalises_by_steps_and_momentum_and_averages_the_directions():
    assert float(normaliser(4, 0.0)) == 4
    assert float(normaliser(3, 0.5)) == pytest.approx(1 + 1.5 + 1.75)
    ctx = tiny_context(n_train=30)
    glob = params_of(ctx, 2)
    alg = build("fednova", ctx)
    state, _ = alg.local_init({"global": glob}, alg.init_client(glob, 0), ctx)
    new, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    trained = sgd_reference(ctx, glob, "train", 1)
    assert metrics["local_steps"] == 3
    for k in glob:
        torch.testing.assert_close(upload["params"][k], (glob[k] - trained[k]) / 3)
    d1 = {k: torch.ones_like(v) for k, v in glob.items()}
    d2 = {k: 3 * torch.ones_like(v) for k, v in glob.items()}
    ups = [{"params": d1, "num_samples": 10, "normaliser": torch.tensor(2.0), "client_id": 0},
           {"params": d2, "num_samples": 30, "normaliser": torch.tensor(6.0), "client_id": 1}]
    merged = alg.aggregate({"global": glob}, ups, 1)["global"]
    tau_eff = 0.25 * 2 + 0.75 * 6
    for k in glob:
        torch.testing.assert_close(merged[k], glob[k] - tau_eff * (0.25 * 1 + 0.75 * 3))


# ---- FedLC, FedNTD, FedDecorr -----------------------------------------------------------------
def test_fedlc_calibration_subtracts_tau_n_to_the_minus_quarter_and_drops_absent_classes():
    z = torch.tensor([[1.0, 2.0, 3.0]])
    out = calibrated_logits(z, torch.tensor([16, 1, 0]), tau=2.0)
    torch.testing.assert_close(out[0, :2], torch.tensor([1.0 - 2.0 * 0.5, 2.0 - 2.0]))
    assert out[0, 2] == float("-inf")
    loss = F.cross_entropy(out, torch.tensor([0]))
    assert math.isfinite(float(loss))


def test_fedntd_distils_only_the_not_true_classes():
    s, t, y = torch.tensor([[2.0, 1.0, 0.0, -1.0]]), torch.tensor([[0.0, 3.0, 1.0, 0.5]]), torch.tensor([1])
    keep = torch.tensor([0, 2, 3])
    ps, pt = F.log_softmax(s[:, keep] / 2.0, 1), F.softmax(t[:, keep] / 2.0, 1)
    expected = 4 * float((pt * (pt.log() - ps)).sum())
    assert float(not_true_kl(s, t, y, tau=2.0)) == pytest.approx(expected, rel=1e-5)
    ctx = tiny_context()
    glob = params_of(ctx, 2)
    zero = build("fedntd", ctx, "fedntd.beta=0.0").local_train({"global": glob}, {"model": dict(glob)}, ctx)[0]
    torch.testing.assert_close(zero["model"], sgd_reference(ctx, glob, "train", 1))


def test_decorrelation_is_the_squared_correlation_norm_over_d_squared():
    h = torch.tensor([[1.0, 2.0], [2.0, 1.0], [3.0, 3.0]])
    z = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5)
    K = z.t() @ z / 3
    assert float(decorrelation(h)) == pytest.approx(float((K ** 2).sum() / 4), rel=1e-5)
    assert float(decorrelation(h[:1])) == 0.0


# ---- FedROD, FedNH, CReFF ----------------------------------------------------------------------
def test_fedrod_trains_the_personal_head_on_detached_features_and_scores_the_summed_head():
    ctx = tiny_context(n_train=20)
    glob = params_of(ctx, 2)
    alg = build("fedrod", ctx)
    state = alg.init_client(glob, 0)
    state, _ = alg.local_init({"global": glob}, state, ctx)
    new, upload, _ = alg.local_train({"global": glob}, state, ctx)
    assert set(upload["params"]) == set(glob)
    head = ["fc.weight", "fc.bias"]
    assert any(not torch.equal(new["personal"][k], glob[k]) for k in head)
    ev = alg.eval_params(new)
    for k in head:
        torch.testing.assert_close(ev[k], new["model"][k] + new["personal"][k])


def test_fednh_spreads_prototypes_keeps_them_on_clients_and_smooths_them_on_the_server():
    P = spread_prototypes(10, 16, 300)
    cos = P @ P.t()
    assert torch.allclose(P.norm(dim=1), torch.ones(10), atol=1e-5) and (cos - torch.eye(10)).max() < 0.3
    ctx = tiny_context(n_train=30)
    alg = build("fednh", ctx, "fednh.spread_steps=50", "fednh.smoothing=0.5")
    server = alg.init_server(params_of(ctx, 2))
    glob = server["global"]
    assert torch.allclose(glob["fc.weight"].norm(dim=1), torch.ones(10), atol=1e-5) and glob["fc.bias"].abs().sum() == 0
    new, upload, _ = alg.local_train({"global": glob}, {"model": dict(glob)}, ctx)
    assert torch.equal(new["model"]["fc.weight"], glob["fc.weight"])  # prototypes frozen on clients
    counts = upload["class_counts"]
    merged = alg.aggregate(server, [{**upload, "client_id": 0}], 1)["global"]
    seen = counts > 0
    expected = F.normalize(0.5 * glob["fc.weight"] + 0.5 * upload["class_means"], dim=1)
    torch.testing.assert_close(merged["fc.weight"][seen], expected[seen])
    torch.testing.assert_close(merged["fc.weight"][~seen], glob["fc.weight"][~seen])


def test_creff_class_gradients_are_the_closed_form_head_gradient():
    ctx = tiny_context(n_train=12)
    params = params_of(ctx, 1)
    fn = head_gradients("fc.weight", "fc.bias", body=3)
    x, y = ctx.data.train_x, ctx.data.train_y
    per_sample = fn(ctx.net, params, x, y)
    leaves = {k: params[k].clone().requires_grad_(True) for k in ("fc.weight", "fc.bias")}
    loss = F.cross_entropy(ctx.net({**params, **leaves}, x[:1], train=False), y[:1])
    gw, gb = torch.autograd.grad(loss, list(leaves.values()))
    torch.testing.assert_close(per_sample[0], torch.cat([gw.flatten(), gb]), rtol=1e-4, atol=1e-6)
    feats = torch.randn(5, 64)
    w, b = params["fc.weight"].clone().requires_grad_(True), params["fc.bias"].clone().requires_grad_(True)
    loss = F.cross_entropy(F.linear(feats, w, b), torch.full((5,), 3))
    gw, gb = torch.autograd.grad(loss, [w, b])
    torch.testing.assert_close(classifier_gradient(feats, 3, params["fc.weight"], params["fc.bias"]),
                               torch.cat([gw.flatten(), gb]), rtol=1e-4, atol=1e-6)


def test_creff_server_retrains_the_classifier_and_evaluates_with_it():
    ctx = tiny_context(n_train=30)
    from pflkit.algorithms import ClientSummary
    import numpy as np
    alg = build("creff", ctx, "creff.features=5", "creff.match_steps=10", "creff.retrain_steps=10")
    glob = params_of(ctx, 2)
    server = alg.prepare(alg.init_server(glob), [ClientSummary(0, 30, np.ones(10))])
    new, upload, _ = alg.local_train({"global": glob}, {"model": dict(glob)}, ctx)
    after = alg.aggregate(server, [{**upload, "client_id": 0}], 1)
    assert not torch.equal(after["features"], server["features"])  # the features moved toward the gradients
    g = alg.global_params(after)
    assert not torch.equal(g["fc.weight"], after["global"]["fc.weight"])  # the re-trained classifier
    assert torch.equal(alg.downlink(after, 0, 2)["global"]["fc.weight"], after["global"]["fc.weight"])

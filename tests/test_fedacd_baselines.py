"""FedACD and its baselines: each update rule against a computation by hand (spec §3)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms.base import ROUND_INFO
from pflkit.algorithms.context import TrainBatches
from pflkit.algorithms.creff import (
    MATCHING_HEAD,
    classifier_gradient,
    fresh_linear,
    head_gradients,
    matching_distance,
    retrain_classifier,
)
from pflkit.algorithms.fedacd import adjustment, fedacd_loss, flattening_kl, reestimate
from pflkit.algorithms.feddecorr import decorrelation
from pflkit.algorithms.fedlc import calibrated_logits
from pflkit.algorithms.fednh import SCALE, spread_prototypes
from pflkit.algorithms.fednova import normaliser
from pflkit.algorithms.fedntd import not_true_kl
from pflkit.config import load_config
from pflkit.functional import torch_generator
from pflkit.functional.training import Batch, clip_by_global_norm, probability_matrix, template_kl
from pflkit.methods import build_algorithm
from pflkit.run.experiment import run_experiment

from helpers import batch_pairs, params_of, sgd_reference, tiny_context


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
    # fedacd.score_rows = "samples": rows weighted by the class counts
    assert float(template_kl(P, torch.tensor([4, 2]), gamma, "samples")) == \
        pytest.approx(float((4 * rows[0] + 2 * rows[1]) / 6), rel=1e-6)
    ctx = tiny_context()
    server = {"global": params_of(ctx, 1)}
    a, b = params_of(ctx, 2), params_of(ctx, 3)
    uploads = [{"params": a, "num_samples": 10, "score": 0.5, "client_id": 0},
               {"params": b, "num_samples": 30, "score": 1.5, "client_id": 1}]
    for agg, weights in (("softmax_neg_score", [math.exp(-0.5), math.exp(-1.5)]), ("uniform", [1, 1]),
                         ("samples", [10, 30]), ("inverse_score", [2.0, 1 / 1.5]),
                         ("softmax_neg_score_x_n", [10 * math.exp(-0.5), 30 * math.exp(-1.5)])):
        alg = build("fedacd", ctx, f'fedacd.agg="{agg}"')
        out = alg.aggregate(server, uploads, 1)
        wa, wb = weights[0] / sum(weights), weights[1] / sum(weights)
        for k in a:
            torch.testing.assert_close(out["global"][k], wa * a[k] + wb * b[k])
        # the weights go into the round's record (the driver moves ROUND_INFO there)
        info = out[ROUND_INFO]["aggregation"]
        assert (info["clients"], info["scores"], info["samples"]) == ([0, 1], [0.5, 1.5], [10, 30])
        assert info["weights"] == pytest.approx([wa, wb])


def test_fedacd_records_its_aggregation_weights_every_round_and_its_own_mixup_setting_wins(tmp_path):
    config = load_config(None, ["dataset=synthetic", "num_clients=4", "alpha=0.5", "rounds=2", "lr=0.05",
                                'algorithms=["fedacd"]', "mixup=true", "fedacd.mixup=false", "engine=loop"])
    seen = []
    real = TrainBatches.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append(self.mixup)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TrainBatches, "__init__", spy)
        run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    assert seen and not any(seen)  # fedacd.mixup = false holds although the run's mixup is true
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "aggregation" in r]
    assert [r["round"] for r in trained] == [1, 2]
    for r in trained:
        agg = r["aggregation"]
        assert sorted(agg["clients"]) == [0, 1, 2, 3] and sum(agg["weights"]) == pytest.approx(1.0)
        expected = torch.softmax(-torch.tensor(agg["scores"], dtype=torch.float64), 0).tolist()
        assert agg["weights"] == pytest.approx(expected)


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


def reference_decorrelation(x: torch.Tensor) -> torch.Tensor:
    """My transcription of bytedance/FedDecorr loss.py (commit 973e4af, FedDecorrLoss.forward):
    0 for one sample; z = (x - mean) / sqrt(1e-8 + unbiased var); M = z^T z; the mean of M's squared
    off-diagonal entries, divided by N."""
    N, d = x.shape
    if N == 1:
        return torch.zeros(())
    z = (x - x.mean(0)) / torch.sqrt(1e-8 + x.var(0))
    M = z.t() @ z
    off = [M[i, j] ** 2 for i in range(d) for j in range(d) if i != j]
    return torch.stack(off).mean() / N


def test_decorrelation_is_the_authors_loss_and_the_papers_form_is_about_n_times_weaker():
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(64, 12, generator=g, dtype=torch.float64) @ torch.randn(12, 12, generator=g, dtype=torch.float64))
    ours = decorrelation(h)
    assert float(ours) == pytest.approx(float(reference_decorrelation(h)), rel=1e-10)
    # padded rows (mask 0) change nothing
    padded = torch.cat([h, torch.randn(5, 12, generator=g, dtype=torch.float64)])
    mask = torch.cat([torch.ones(64), torch.zeros(5)]).double()
    assert float(decorrelation(padded, mask)) == pytest.approx(float(ours), rel=1e-10)
    assert float(decorrelation(h[:1])) == 0.0 == float(decorrelation(h[:1], form="paper"))
    # the paper's form: ||K||_F^2 / d^2; the same gradient direction, (N-1)^2 d / (N (d-1)) times smaller
    z = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5)
    assert float(decorrelation(h, form="paper")) == pytest.approx(float(((z.t() @ z / 64) ** 2).sum() / 144), rel=1e-8)
    grads = [torch.autograd.grad(decorrelation(x, form=form), x)[0]
             for form in ("reference", "paper") for x in [h.clone().requires_grad_()]]
    assert float(F.cosine_similarity(grads[0].flatten(), grads[1].flatten(), dim=0)) == pytest.approx(1.0, abs=1e-6)
    assert float(grads[0].norm() / grads[1].norm()) == pytest.approx(63 ** 2 * 12 / (64 * 11), rel=1e-3)


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


def reference_fednh_client(ctx, glob: dict, scale: float, lr: float, clip: float) -> tuple[dict, float]:
    """My transcription of the authors' FedNH client (Yutong-Dai/FedNH 60c3161, FedUH.py training
    loop with FedNH's model): logits = s * normalise(h) @ P^T with the prototypes P frozen, CE,
    backward into the body and s, clip_grad_norm_(body + s, clip), then an SGD step."""
    from pflkit.functional import forward

    body_names = [k for k in glob if not k.startswith("fc.")]
    w = {k: v.detach().clone() for k, v in glob.items()}
    s = torch.tensor(scale)
    for x, y in batch_pairs(ctx, "train", 1):
        leaves = {k: w[k].clone().requires_grad_(True) for k in body_names}
        s_leaf = s.clone().requires_grad_(True)
        h = forward(ctx.model, {**w, **leaves}, x, train=True, stop=len(ctx.units) - 1).flatten(1)
        logits = s_leaf * (h / h.norm(dim=1, keepdim=True).clamp(min=1e-12)) @ w["fc.weight"].t()
        grads = torch.autograd.grad(F.cross_entropy(logits, y), [*leaves.values(), s_leaf])
        total = torch.sqrt(sum((g ** 2).sum() for g in grads))
        coef = min(1.0, clip / (float(total) + 1e-6))
        for (k, v), g in zip(leaves.items(), grads):
            w[k] = (v - lr * coef * g).detach()
        s = (s_leaf - lr * coef * grads[-1]).detach()
    return w, float(s)


def test_fednh_orthogonal_prototypes_learnable_scale_clipping_and_uniform_server_mean():
    P = spread_prototypes(10, 16, 300)  # the option prototype_init = "spread"
    cos = P @ P.t()
    assert torch.allclose(P.norm(dim=1), torch.ones(10), atol=1e-5) and (cos - torch.eye(10)).max() < 0.3
    ctx = tiny_context(n_train=30, lr=0.5)
    alg = build("fednh", ctx, "fednh.smoothing=0.5", "fednh.clip_norm=0.5")
    server = alg.init_server(params_of(ctx, 2))
    glob = server["global"]
    W = glob["fc.weight"]  # orthonormal rows (10 <= 64 features)
    torch.testing.assert_close(W @ W.t(), torch.eye(10), atol=1e-5, rtol=0)
    assert glob["fc.bias"].abs().sum() == 0 and float(server[SCALE]) == 1.0
    state, _ = alg.local_init(alg.downlink(server, 0, 1), alg.init_client(params_of(ctx, 5), 0), ctx)
    assert float(state[SCALE]) == 1.0 and torch.equal(state["model"]["fc.weight"], W)
    new, upload, _ = alg.local_train(alg.downlink(server, 0, 1), state, ctx)
    assert torch.equal(new["model"]["fc.weight"], W)  # prototypes frozen on clients
    expected, expected_scale = reference_fednh_client(ctx, glob, 1.0, lr=0.5, clip=0.5)
    torch.testing.assert_close(new["model"], expected, rtol=1e-4, atol=1e-6)
    assert float(upload["scale"]) == pytest.approx(expected_scale, rel=1e-5) and expected_scale != 1.0
    # evaluation ranks classes by s * cos: the scored head is s * W
    torch.testing.assert_close(alg.eval_params(new)["fc.weight"], new[SCALE] * W)
    # server: uniform mean of the bodies and of s (not sample-weighted); prototypes smoothed where seen
    other = {**upload, "params": {k: v + 1.0 for k, v in upload["params"].items()}, "num_samples": 90,
             "scale": torch.tensor(3.0), "client_id": 1}
    out = alg.aggregate(server, [{**upload, "client_id": 0}, other], 1)
    merged = out["global"]
    body = [k for k in glob if not k.startswith("fc.")]
    for k in body:
        torch.testing.assert_close(merged[k], upload["params"][k] + 0.5)
    assert float(out[SCALE]) == pytest.approx((expected_scale + 3.0) / 2, rel=1e-6)
    counts = upload["class_counts"] + other["class_counts"]
    seen = counts > 0
    average = F.normalize(upload["class_counts"][:, None] * upload["class_means"]
                          + other["class_counts"][:, None] * other["class_means"], dim=1)
    smoothed = F.normalize(0.5 * W + 0.5 * average, dim=1)
    torch.testing.assert_close(merged["fc.weight"][seen], smoothed[seen])
    torch.testing.assert_close(merged["fc.weight"][~seen], W[~seen])
    weighted = build("fednh", ctx, "fednh.body_weights='samples'").aggregate(
        server, [{**upload, "client_id": 0}, other], 1)
    for k in body:
        torch.testing.assert_close(weighted["global"][k], upload["params"][k] + 0.75)


def test_sgd_clips_the_global_gradient_norm_like_torch_per_client_when_batched():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, 4, generator=g) * 5, torch.randn(4, generator=g) * 5]
    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(4, requires_grad=True)]
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm=2.0)
    ours = clip_by_global_norm(grads, 2.0)
    for p, c in zip(params, ours):
        torch.testing.assert_close(c, p.grad)
    small = clip_by_global_norm([gr * 1e-3 for gr in grads], 2.0)  # below the norm: unchanged
    torch.testing.assert_close(small[0], grads[0] * 1e-3)
    stacked = clip_by_global_norm([torch.stack([grads[0], grads[0] * 1e-3]), torch.stack([grads[1], grads[1] * 1e-3])],
                                  2.0, batched=True)
    torch.testing.assert_close(stacked[0][0], ours[0])
    torch.testing.assert_close(stacked[0][1], grads[0] * 1e-3)


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


def reference_creff_distance(g_syn_w, g_syn_b, g_real_w, g_real_b) -> torch.Tensor:
    """My transcription of the authors' 'ours' distance (shangxinyi/CReFF-FL fbec98f,
    Dataset/Gradient_matching_loss.py distance_wb, summed over the [W, b] tensors in match_loss):
    a weight gradient [C, d] gives sum over rows i of 1 - <gr_i, gs_i> / (|gr_i| |gs_i| + 1e-6); the
    bias [C] is reshaped to [1, C] and gives one such term."""
    total = torch.zeros((), dtype=g_syn_w.dtype)
    for gs, gr in ((g_syn_w, g_real_w), (g_syn_b.reshape(1, -1), g_real_b.reshape(1, -1))):
        for i in range(gs.shape[0]):
            total = total + 1 - (gr[i] * gs[i]).sum() / (gr[i].norm() * gs[i].norm() + 1e-6)
    return total


def test_creff_matches_features_with_the_authors_row_wise_distance_at_last_rounds_classifier():
    g = torch.Generator().manual_seed(0)
    C, m, d = 3, 4, 5
    W, b = torch.randn(C, d, generator=g, dtype=torch.float64), torch.randn(C, generator=g, dtype=torch.float64)
    feats = torch.randn(C, m, d, generator=g, dtype=torch.float64)
    target = torch.randn(C, C * d + C, generator=g, dtype=torch.float64)
    # one step of the reference: sum over the held classes of the distance, gradient w.r.t. the features
    leaf = feats.clone().requires_grad_(True)
    loss = 0
    for c in (0, 2):
        Wl, bl = W.clone().requires_grad_(True), b.clone().requires_grad_(True)
        gw, gb = torch.autograd.grad(F.cross_entropy(leaf[c] @ Wl.t() + bl, torch.full((m,), c)), [Wl, bl],
                                     create_graph=True)
        loss = loss + reference_creff_distance(gw, gb, target[c, :C * d].reshape(C, d), target[c, C * d:])
    (grad,) = torch.autograd.grad(loss, [leaf])
    expected = feats - 0.1 * grad
    ctx = tiny_context()
    alg = build("creff", ctx, "creff.match_steps=1", "creff.feature_lr=0.1")
    torch.testing.assert_close(alg.match(feats, target, [0, 2], W, b), expected, rtol=1e-10, atol=1e-12)
    assert float(matching_distance(target[0], target[0], C)) == pytest.approx(0.0, abs=1e-5)


def test_creff_round_gradients_at_the_retrained_head_plain_mean_and_a_fresh_retrained_classifier():
    ctx = tiny_context(n_train=30)
    import numpy as np

    from pflkit.algorithms import ClientSummary
    alg = build("creff", ctx, "creff.features=5", "creff.match_steps=3", "creff.retrain_epochs=2")
    glob = params_of(ctx, 2)
    server = alg.prepare(alg.init_server(glob), [ClientSummary(0, 30, np.ones(10))], seed=7)
    head = server["head"]
    assert not torch.equal(head["fc.weight"], glob["fc.weight"])  # round 1: a fresh linear layer
    assert head["fc.weight"].abs().max() <= 1 / 8  # nn.Linear's U(-1/sqrt(64), 1/sqrt(64))
    payload = alg.downlink(server, 0, 1)
    assert torch.equal(payload["global"]["fc.weight"], glob["fc.weight"])  # clients train from the average
    new, upload, _ = alg.local_train(payload, {"model": dict(glob)}, ctx)
    # the real gradients are taken at the received body with the server's re-trained head
    per_sample = head_gradients("fc.weight", "fc.bias", 3)(ctx.net, {**glob, **head}, ctx.data.train_x,
                                                         ctx.data.train_y)
    for c in range(10):
        rows = ctx.data.train_y == c
        if rows.any():
            torch.testing.assert_close(upload["class_grads"][c], per_sample[rows].mean(0), rtol=1e-5, atol=1e-7)
    # the server's target: a plain mean over the clients holding the class (not count-weighted)
    other = {**upload, "class_grads": upload["class_grads"] + 1.0, "class_counts": upload["class_counts"] * 5,
             "client_id": 1}
    seen = []
    real_match = alg.match
    alg.match = lambda features, target, classes, weight, bias: seen.append((target, classes, weight)) or \
        real_match(features, target, classes, weight, bias)
    after = alg.aggregate(server, [{**upload, "client_id": 0}, other], 1)
    target, classes, weight = seen[0]
    held = upload["class_counts"] > 0
    torch.testing.assert_close(target[held], upload["class_grads"][held] + 0.5)
    assert classes == torch.nonzero(held).flatten().tolist()
    assert torch.equal(weight, head["fc.weight"])  # matched at the same classifier as the clients' gradients
    # a fresh classifier re-trained on the moved features: 2 epochs of ceil(50 / 10) batches
    g = torch_generator(7, "server", 1, "creff")
    w0, b0 = fresh_linear(64, 10, g)
    w, b = retrain_classifier(after["features"], w0, b0, 2, 10, 0.01, g)
    torch.testing.assert_close(after["head"]["fc.weight"], w)
    torch.testing.assert_close(alg.global_params(after)["fc.weight"], w)
    assert torch.equal(alg.downlink(after, 0, 2)[MATCHING_HEAD]["fc.weight"], w)
    assert torch.equal(alg.downlink(after, 0, 2)["global"]["fc.weight"], after["global"]["fc.weight"])


def test_creff_retraining_is_minibatch_sgd_from_the_given_start():
    """My transcription of the authors' feature_re_train: for each epoch, shuffled mini-batches
    (the last smaller), CE, plain SGD at lr on weight and bias."""
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    w0, b0 = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    w, b = retrain_classifier(feats, w0, b0, epochs=2, batch=4, lr=0.5, generator=torch.Generator().manual_seed(3))
    order_g = torch.Generator().manual_seed(3)
    x, y = feats.reshape(15, 4), torch.arange(3).repeat_interleave(5)
    rw, rb = w0.clone(), b0.clone()
    steps = 0
    for _ in range(2):
        order = torch.randperm(15, generator=order_g)
        for start in range(0, 15, 4):
            idx = order[start:start + 4]
            p = torch.softmax(x[idx] @ rw.t() + rb, dim=1)
            err = (p - F.one_hot(y[idx], 3).double()) / len(idx)
            rw, rb = rw - 0.5 * err.t() @ x[idx], rb - 0.5 * err.sum(0)
            steps += 1
    assert steps == 8
    torch.testing.assert_close(w, rw)
    torch.testing.assert_close(b, rb)


# ---- learning-rate decay (FedNH's and FedNTD's code: lr * 0.99^(r-1)) -------------------------------
def test_lr_decay_trains_round_r_at_lr_times_decay_to_the_r_minus_1():
    from pflkit.algorithms import TrainSettings
    from pflkit.engines.client import SingleClientContext

    base = tiny_context(n_train=30)
    train = TrainSettings(batch_size=10, local_epochs=1, lr=0.1, lr_decay=0.5, rounds=5)
    assert [train.at_round(r).lr for r in (0, 1, 2, 3, 5, 6)] == [0.1, 0.1, 0.05, 0.025, 0.00625, 0.00625]
    assert TrainSettings(lr=0.1).at_round(7).lr == 0.1
    glob = params_of(base, 2)
    for engine_context in ("single", "batched"):
        ctx = SingleClientContext(client_id=0, round=3, seed=0, data=base.data, model=base.model, units=base.units,
                                  train=train, algorithm="test")
        assert ctx.train.lr == 0.025
        alg = build("fedavg", ctx)
        if engine_context == "single":
            trained = alg.local_train({"global": glob}, {"model": dict(glob)}, ctx)[0]["model"]
        else:  # the batched context of the vmap and parallel engines decays the same way
            from pflkit.data.federated import FederatedData
            from pflkit.engines.batched import BatchedClientContext
            from pflkit.engines.stacking import stack, unstack

            fed = FederatedData.from_clients([base.data], 10, "toy")
            bctx = BatchedClientContext([0], 3, 0, fed, base.model, base.units, train, "test")
            assert bctx.train.lr == 0.025
            out = alg.local_train(stack([{"global": glob}]), stack([{"model": dict(glob)}]), bctx)[0]
            trained = unstack(out, 0, {"model": glob})["model"]
        torch.testing.assert_close(trained, sgd_reference(ctx, glob, "train", 1, lr=0.025), rtol=1e-5, atol=1e-6)


def test_lr_decay_is_a_config_key_that_reaches_training():
    config = load_config(None, ["lr_decay=0.99"])
    assert config.train.lr_decay == 0.99
    with pytest.raises(Exception, match="lr_decay"):
        load_config(None, ["lr_decay=1.5"])


def test_fedrods_adaptability_metrics_score_its_uploaded_generic_model(monkeypatch, tmp_path):
    """FedACD's Tables 3 and 9 score each client's local model, the one it uploads: FedROD's generic
    model (body and W_g), not its personalised head W_g + W_p."""
    from pflkit.federation.evaluation import AdaptabilityMetrics

    scored = []
    real = AdaptabilityMetrics.__call__
    monkeypatch.setattr(AdaptabilityMetrics, "__call__",
                        lambda self, setup, client_id, params: scored.append(params) or real(self, setup, client_id,
                                                                                             params))
    uploads = []
    real_upload = build("fedrod", tiny_context()).__class__.upload
    monkeypatch.setattr(type(build("fedrod", tiny_context())), "upload",
                        staticmethod(lambda params, ctx, **extra: uploads.append(dict(params))
                                     or real_upload(params, ctx, **extra)))
    config = load_config(None, ["dataset=synthetic", "num_clients=3", "alpha=0.5", "rounds=1", "lr=0.05",
                                "test_set=official", "metrics.adaptability=true", 'algorithms=["fedrod"]',
                                "engine=loop"])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    assert len(scored) == len(uploads) == 3
    for params, upload in zip(scored, uploads):
        assert params.keys() == upload.keys()
        assert all(torch.equal(params[k], upload[k]) for k in params)
    ctx = tiny_context()
    alg = build("fedrod", ctx)
    state = alg.init_client(params_of(ctx, 1), 0)
    state["personal"] = {k: v + 1.0 for k, v in state["personal"].items()}
    assert alg.local_model(state) is state["model"]
    assert not torch.equal(alg.eval_params(state)["fc.weight"], state["model"]["fc.weight"])


@pytest.mark.parametrize("p_update", ["epoch", "round"])
def test_fedacd_p_update_decides_whether_P_follows_the_epochs(p_update, monkeypatch):
    """p_update = "round" trains all epochs against the round-start P; "epoch" re-estimates it."""
    import pflkit.algorithms.fedacd as fedacd

    seen = []
    original = fedacd.adjustment
    monkeypatch.setattr(fedacd, "adjustment", lambda P, *a: (seen.append(P.detach().clone()), original(P, *a))[1])
    ctx = tiny_context(n_train=20)
    ctx.train = ctx.train.model_copy(update={"local_epochs": 2})
    alg = build("fedacd", ctx, f'fedacd.p_update="{p_update}"', "fedacd.mixup=false")
    alg.local_train({"global": params_of(ctx, 1)}, {"model": params_of(ctx, 1)}, ctx)
    per_epoch = len(seen) // 2
    assert per_epoch >= 1 and len(seen) == 2 * per_epoch
    first, second = seen[0], seen[per_epoch]
    assert all(torch.equal(first, P) for P in seen[:per_epoch])  # fixed within an epoch
    assert torch.equal(first, second) == (p_update == "round")

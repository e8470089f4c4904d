"""CReFF: the class gradients, the matching distance, the server's round and the classifier's
re-training against computations by hand (docs/reference/methods/creff.md), and the server step
against my own transcription of the authors' code, over several gradient-matching steps (one step
cannot tell a loop that stops early from the full loop).

Reference read (written from reading it, not copied): shangxinyi/CReFF-FL fbec98f, ``main.py``
(``Global.update_feature_syn``: per class the plain mean of the clients' gradients, then
``match_epoch`` steps of SGD on the federated features, each on the sum over the held classes of
the matching loss between the classifier's gradient on the class's features (autograd with
``create_graph``) and that mean; ``Global.initialize_for_model_fusion``: the sample-weighted
average), ``Dataset/Gradient_matching_loss.py`` (``match_loss`` with ``dis_metric = "ours"``,
``distance_wb``: 1 - cosine per row of the weight gradient, the bias gradient as one row, 1e-6 in
the denominator).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms import ClientSummary
from pflkit.algorithms.creff import (
    MATCHING_HEAD,
    classifier_gradient,
    fresh_linear,
    head_gradients,
    matching_distance,
    retrain_classifier,
)
from pflkit.engines import SingleClientContext
from pflkit.functional import torch_generator
from tests.support.builders import build, client_context, params_of, tiny_context


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
    torch.testing.assert_close(
        classifier_gradient(feats, 3, params["fc.weight"], params["fc.bias"]),
        torch.cat([gw.flatten(), gb]),
        rtol=1e-4,
        atol=1e-6,
    )


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
        gw, gb = torch.autograd.grad(
            F.cross_entropy(leaf[c] @ Wl.t() + bl, torch.full((m,), c)), [Wl, bl], create_graph=True
        )
        loss = loss + reference_creff_distance(gw, gb, target[c, : C * d].reshape(C, d), target[c, C * d :])
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
    per_sample = head_gradients("fc.weight", "fc.bias", 3)(
        ctx.net, {**glob, **head}, ctx.data.train_x, ctx.data.train_y
    )
    for c in range(10):
        rows = ctx.data.train_y == c
        if rows.any():
            torch.testing.assert_close(upload["class_grads"][c], per_sample[rows].mean(0), rtol=1e-5, atol=1e-7)
    # the server's target: a plain mean over the clients holding the class (not count-weighted)
    other = {
        **upload,
        "class_grads": upload["class_grads"] + 1.0,
        "class_counts": upload["class_counts"] * 5,
        "client_id": 1,
    }
    seen = []
    real_match = alg.match
    alg.match = lambda features, target, classes, weight, bias: (
        seen.append((target, classes, weight)) or real_match(features, target, classes, weight, bias)
    )
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
            idx = order[start : start + 4]
            p = torch.softmax(x[idx] @ rw.t() + rb, dim=1)
            err = (p - F.one_hot(y[idx], 3).double()) / len(idx)
            rw, rb = rw - 0.5 * err.t() @ x[idx], rb - 0.5 * err.sum(0)
            steps += 1
    assert steps == 8
    torch.testing.assert_close(w, rw)
    torch.testing.assert_close(b, rb)


# ---- the server step over several matching steps ---------------------------------------------


def client(cid: int, classes: list[int], n_train: int) -> SingleClientContext:
    """Client ``cid`` with labels from ``classes`` (data seed 400 + cid) and the digits CNN (seed 0)."""
    return client_context(
        cid,
        n_train=n_train,
        data_seed=400 + cid,
        classes=classes,
        algorithm="creff",
        batch_size=10,
        local_epochs=1,
        lr=0.1,
    )


def distance_wb(gwr: torch.Tensor, gws: torch.Tensor) -> torch.Tensor:
    """distance_wb for a linear layer's gradients: rows of a 2-d gradient, a 1-d one as one row."""
    if gwr.dim() == 1:
        gwr, gws = gwr.reshape(1, -1), gws.reshape(1, -1)
    return torch.sum(1 - torch.sum(gwr * gws, dim=-1) / (torch.norm(gwr, dim=-1) * torch.norm(gws, dim=-1) + 1e-6))


def authors_update_feature_syn(
    features: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    real: dict[int, list[torch.Tensor]],
    steps: int,
    lr: float,
) -> torch.Tensor:
    """update_feature_syn: feature_net = nn.Linear(d, C) holding (weight, bias); feature_syn is one
    [C * m, d] leaf under torch.optim.SGD(lr); ``real`` maps each held class to its averaged
    [weight gradient, bias gradient]. Returns the features as [C, m, d]."""
    C, m, d = features.shape
    net = nn.Linear(d, C).to(features.dtype)
    with torch.no_grad():
        net.weight.copy_(weight)
        net.bias.copy_(bias)
    params = list(net.parameters())
    feature_syn = features.reshape(C * m, d).clone().requires_grad_(True)
    opt = torch.optim.SGD([feature_syn], lr=lr)
    for _ in range(steps):
        loss = torch.zeros((), dtype=features.dtype)
        for c in range(C):
            if c not in real:
                continue
            out = net(feature_syn[c * m : (c + 1) * m].reshape(m, d))
            gw_syn = torch.autograd.grad(F.cross_entropy(out, torch.full((m,), c)), params, create_graph=True)
            loss = loss + sum(distance_wb(gr, gs) for gr, gs in zip(real[c], gw_syn))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return feature_syn.detach().reshape(C, m, d)


def test_creff_feature_matching_is_the_authors_loop_over_several_steps():
    """float64, four classes of which three are held, five matching steps: equal to rounding."""
    g = torch.Generator().manual_seed(5)
    C, m, d = 4, 3, 6
    W = torch.randn(C, d, generator=g, dtype=torch.float64)
    b = torch.randn(C, generator=g, dtype=torch.float64)
    feats = torch.randn(C, m, d, generator=g, dtype=torch.float64)
    target = torch.randn(C, C * d + C, generator=g, dtype=torch.float64)
    held = [0, 2, 3]
    real = {c: [target[c, : C * d].reshape(C, d), target[c, C * d :]] for c in held}
    ctx = client(0, [0, 1], 10)
    for steps in (1, 5):
        alg = build("creff", ctx, f"creff.match_steps={steps}", "creff.feature_lr=0.5")
        ours = alg.match(feats, target, held, W, b)
        theirs = authors_update_feature_syn(feats, W, b, real, steps, lr=0.5)
        # the same loss, its gradient through torch's double backward or pflkit's closed form
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    one = authors_update_feature_syn(feats, W, b, real, 1, lr=0.5)
    assert float((theirs - one).abs().max()) > 1e-2  # the later steps move the features on
    torch.testing.assert_close(ours[1], feats[1])  # a class no client holds is not moved


def test_creff_server_round_averages_and_matches_as_the_authors_server():
    """Two clients (classes 0-4 and 3-7, 8 and 9 held by neither) upload their class gradients at
    the round's classifier; the server averages the models by samples, each class's gradient
    over the clients holding it, and runs four matching steps (``retrain_epochs = 0`` leaves the
    re-training, tested above, out)."""
    ctxs = [client(0, [0, 1, 2, 3, 4], 30), client(1, [3, 4, 5, 6, 7], 50)]
    alg = build(
        "creff", ctxs[0], "creff.features=3", "creff.match_steps=4", "creff.feature_lr=0.1", "creff.retrain_epochs=0"
    )
    summaries = [ClientSummary(c.client_id, c.num_train, c.label_counts.numpy()) for c in ctxs]
    server = alg.prepare(alg.init_server(params_of(ctxs[0], 2)), summaries, seed=3)
    uploads = []
    for ctx in ctxs:
        payload = alg.downlink(server, ctx.client_id, 1)
        new, upload, _ = alg.local_train(payload, {"model": dict(payload["global"])}, ctx)
        uploads.append({**upload, "client_id": ctx.client_id})
    after = alg.aggregate(server, uploads, 1)

    C, d = 10, 64
    real = {}
    for c in range(C):  # gw_real_avg: weight 1 / (clients holding c) each
        holders = [u for u in uploads if u["class_counts"][c] > 0]
        if holders:
            grads = [u["class_grads"][c] for u in holders]
            real[c] = [
                sum(gr[: C * d] / len(holders) for gr in grads).reshape(C, d),
                sum(gr[C * d :] / len(holders) for gr in grads),
            ]
    assert sorted(real) == list(range(8))
    head = server["head"]
    theirs = authors_update_feature_syn(server["features"], head["fc.weight"], head["fc.bias"], real, 4, lr=0.1)
    # float32: the gradient of the matching loss by double backward against pflkit's closed form, over
    # four steps: measured 1.2e-7 apart at most (an ulp or two) on features up to 3.7, moved by up to
    # 0.13; rtol is torch's float32 default, atol covers entries near 0
    torch.testing.assert_close(after["features"], theirs, rtol=1.3e-6, atol=1e-6)
    one = authors_update_feature_syn(server["features"], head["fc.weight"], head["fc.bias"], real, 1, lr=0.1)
    assert float((theirs - one).abs().max()) > 1e-3
    torch.testing.assert_close(after["features"][8:], server["features"][8:])
    # initialize_for_model_fusion: sample-weighted average of the uploaded models
    n = np.array([30.0, 50.0])
    for k, v in after["global"].items():
        expected = (uploads[0]["params"][k] * n[0] + uploads[1]["params"][k] * n[1]) / n.sum()
        torch.testing.assert_close(v, expected, rtol=1.3e-6, atol=1e-7, msg=k)

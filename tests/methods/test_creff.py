"""CReFF's server step against my own transcription of the authors' code, over several
gradient-matching steps (one step cannot tell a loop that stops early from the full loop).

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
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms import ClientSummary, TrainSettings
from pflkit.config import load_config
from pflkit.data.federated import ClientData
from pflkit.engines import SingleClientContext
from pflkit.methods import build_algorithm
from pflkit.models import build_model

from helpers import params_of


def client(cid: int, classes: list[int], n_train: int) -> SingleClientContext:
    torch.manual_seed(0)
    model = build_model("digits_cnn", (1, 8, 8), 10)
    g = torch.Generator().manual_seed(400 + cid)
    x = torch.randn(n_train + 8, 1, 8, 8, generator=g)
    labels = torch.tensor(classes)
    y = labels[torch.randint(0, len(labels), (n_train + 8,), generator=g)]
    data = ClientData(cid, x[:n_train], y[:n_train], x[n_train:], y[n_train:])
    train = TrainSettings(batch_size=10, local_epochs=1, lr=0.1)
    return SingleClientContext(client_id=cid, round=1, seed=0, data=data, model=model, units=model.units(),
                               train=train, algorithm="creff")


def build(ctx, *overrides: str):
    return build_algorithm("creff", load_config(None, list(overrides)).algorithm_sections(), ctx.train, ctx.units)


def distance_wb(gwr: torch.Tensor, gws: torch.Tensor) -> torch.Tensor:
    """distance_wb for a linear layer's gradients: rows of a 2-d gradient, a 1-d one as one row."""
    if gwr.dim() == 1:
        gwr, gws = gwr.reshape(1, -1), gws.reshape(1, -1)
    return torch.sum(1 - torch.sum(gwr * gws, dim=-1) / (torch.norm(gwr, dim=-1) * torch.norm(gws, dim=-1) + 1e-6))


def authors_update_feature_syn(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                               real: dict[int, list[torch.Tensor]], steps: int, lr: float) -> torch.Tensor:
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
            out = net(feature_syn[c * m:(c + 1) * m].reshape(m, d))
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
    real = {c: [target[c, :C * d].reshape(C, d), target[c, C * d:]] for c in held}
    ctx = client(0, [0, 1], 10)
    for steps in (1, 5):
        alg = build(ctx, f"creff.match_steps={steps}", "creff.feature_lr=0.5")
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
    re-training, tested in test_fedacd_baselines.py, out)."""
    ctxs = [client(0, [0, 1, 2, 3, 4], 30), client(1, [3, 4, 5, 6, 7], 50)]
    alg = build(ctxs[0], "creff.features=3", "creff.match_steps=4", "creff.feature_lr=0.1", "creff.retrain_epochs=0")
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
            real[c] = [sum(gr[:C * d] / len(holders) for gr in grads).reshape(C, d),
                       sum(gr[C * d:] / len(holders) for gr in grads)]
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

"""MOON: the contrastive loss by hand, and the client against my transcriptions of the authors' code
(QinbinLi/MOON 8fcba3c, ``main.py`` train_net_fedcon and the moon round loop; ``model.py``
ModelFedCon, whose projection output is here the body's output) and of PFLlib f1e313a
(``clientmoon.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms.moon import contrastive
from tests.support.builders import batch_pairs, build, params_of, perturbed, seeded_client
from tests.support.checks import assert_expected_close, moved
from tests.support.references import BODY, module_at, network, sgd_reference, weights


def test_contrastive_loss_by_hand():
    z, zg, zp = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0]])
    pos, neg = math.exp(math.sqrt(0.5) / 0.5), math.exp(0.0)
    assert float(contrastive(z, zg, zp, 0.5)) == pytest.approx(-math.log(pos / (pos + neg)), rel=1e-6)


def pflkit_client(ctx, glob, local, previous, *overrides):
    alg = build("moon", ctx, *overrides)
    state, _ = alg.local_init({"global": glob}, {"model": local, "previous": previous}, ctx)
    new, upload, _ = alg.local_train({"global": glob}, state, ctx)
    assert_expected_close(new["previous"], new["model"])  # the trained model is the next previous one
    return new["model"], upload["params"]


# ============================================================================ the authors' code
def authors_train_net_fedcon(ctx, glob, previous_nets, mu: float, temperature: float) -> dict:
    """train_net_fedcon: SGD(lr, momentum 0.9, weight decay ``reg``) on the net loaded with the global
    weights; the global and previous nets frozen in eval mode. Per batch: logits = [cos(pro1, pro2)]
    + [cos(pro1, pro3) per previous net], / temperature, loss2 = μ CE(logits, 0), loss1 = CE(out, y)."""
    net, global_net = module_at(ctx.model, glob), module_at(ctx.model, glob).eval()
    previous = [module_at(ctx.model, p).eval() for p in previous_nets]
    opt = torch.optim.SGD(net.parameters(), lr=ctx.train.lr, momentum=0.9, weight_decay=ctx.train.weight_decay)
    net.train()
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        opt.zero_grad()
        pro1 = net(x, stop=BODY)  # ModelFedCon returns (h, projection, out); no projection head here
        out = net(pro1, start=BODY)
        with torch.no_grad():
            pro2 = global_net(x, stop=BODY)
        logits = F.cosine_similarity(pro1, pro2, dim=-1).reshape(-1, 1)
        for prev in previous:
            with torch.no_grad():
                pro3 = prev(x, stop=BODY)
            logits = torch.cat((logits, F.cosine_similarity(pro1, pro3, dim=-1).reshape(-1, 1)), dim=1)
        logits = logits / temperature
        loss2 = mu * F.cross_entropy(logits, torch.zeros(x.shape[0], dtype=torch.long))
        (F.cross_entropy(out, y) + loss2).backward()
        opt.step()
    return weights(net)


@pytest.mark.parametrize("overrides,mu,tau", [((), 1.0, 0.5), (("moon.mu=5.0", "moon.tau=0.2"), 5.0, 0.2)])
def test_moon_matches_the_authors_train_net_fedcon(overrides, mu, tau):
    ctx = seeded_client(40, seed=3, lr=0.05, momentum=0.9, weight_decay=1e-5, epochs=2, round=2)
    glob, local, previous = params_of(ctx, 2), params_of(ctx, 5), perturbed(params_of(ctx, 2), 1, 0.3)
    model, upload = pflkit_client(ctx, glob, local, previous, *overrides)
    expected = authors_train_net_fedcon(ctx, glob, [previous], mu, tau)
    assert_expected_close(model, expected)
    assert_expected_close(upload, expected)
    assert moved(expected, authors_train_net_fedcon(ctx, glob, [previous], 0.0, tau))  # ℓ_con matters here


def test_moon_round_one_is_fedavg():
    """Round 1: the authors' pool of previous nets is empty, the logits one column, and loss2 = 0."""
    ctx = seeded_client(30, seed=1, lr=0.1, momentum=0.9, weight_decay=1e-5, round=1)
    glob = params_of(ctx, 2)
    model, _ = pflkit_client(ctx, glob, params_of(ctx, 5), perturbed(glob, 1, 0.3))
    assert_expected_close(model, authors_train_net_fedcon(ctx, glob, [], 1.0, 0.5))
    plain = seeded_client(30, seed=1, lr=0.1, round=1)
    model, _ = pflkit_client(plain, glob, params_of(plain, 5), perturbed(glob, 1, 0.3))
    torch.testing.assert_close(model, sgd_reference(plain, glob, "train", 1))


# ============================================================================ PFLlib f1e313a
def pfllib_moon_client(ctx, glob, old, mu: float, tau: float) -> dict:
    """clientMOON.train: plain SGD; rep = model.base(x), output = model.predictor(rep); rep_old and
    rep_global detached; loss += μ mean(−log(e^{cos(rep, rep_g)/τ} / (e^{cos(rep, rep_g)/τ}
    + e^{cos(rep, rep_old)/τ})))."""
    net, global_model, old_model = network(ctx, glob), network(ctx, glob), network(ctx, old)
    opt = torch.optim.SGD(net.parameters(), lr=ctx.train.lr)
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        opt.zero_grad()
        rep = net(x, stop=BODY)
        loss = F.cross_entropy(net(rep, start=BODY), y)
        rep_old, rep_global = old_model(x, stop=BODY).detach(), global_model(x, stop=BODY).detach()
        pos = torch.exp(F.cosine_similarity(rep, rep_global) / tau)
        loss_con = -torch.log(pos / (pos + torch.exp(F.cosine_similarity(rep, rep_old) / tau)))
        (loss + mu * torch.mean(loss_con)).backward()
        opt.step()
    return weights(net)


def test_moon_matches_pfllibs_client():
    ctx = seeded_client(30, seed=4, lr=0.1, epochs=2, round=3)
    glob, previous = params_of(ctx, 2), perturbed(params_of(ctx, 2), 2, 0.3)
    model, _ = pflkit_client(ctx, glob, params_of(ctx, 6), previous, "moon.mu=2.0", "moon.tau=1.0")
    assert_expected_close(model, pfllib_moon_client(ctx, glob, previous, 2.0, 1.0))

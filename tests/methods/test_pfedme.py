"""pFedMe (docs/reference/methods/pfedme.md): every update rule recomputed by hand, and against my
transcription of PFLlib f1e313a (``clients/clientpFedMe.py``, ``optimizers/fedoptimizer.py``:
pFedMeOptimizer, ``servers/serverpFedMe.py``)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.support.builders import batch_pairs, build, params_of, tiny_context, two_client_round
from tests.support.checks import assert_params_close, differs, moved
from tests.support.references import grads, network, pfllib_server_average, weights


def pfedme_by_hand(ctx, w, theta, batches, *, eta, lam, K, lr, l2=0.0):
    w, theta = dict(w), dict(theta)
    for x, y in batches:
        for _ in range(K):
            g = grads(ctx.model, theta, x, y)
            theta = {k: theta[k] - eta * (g[k] + lam * (theta[k] - w[k]) + l2 * theta[k]) for k in theta}
        w = {k: w[k] - lr * lam * (w[k] - theta[k]) for k in w}
    return w, theta


@pytest.mark.parametrize("l2", [0.0, 0.01])
def test_pfedme_inner_steps_and_local_update(l2):
    ctx = tiny_context(n_train=20, batch_size=10, lr=0.1)  # two batches: theta is warm-started
    alg = build("pfedme", ctx, "pfedme.personal_lr=0.05", "pfedme.lam=2.0", "pfedme.inner_steps=3", f"pfedme.l2={l2}")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)
    assert_params_close(alg.eval_params(state), local, rtol=0, atol=0)  # last theta = Theta^0 so far
    new, upload, _ = alg.local_train({"global": glob}, state, ctx)
    w, theta = pfedme_by_hand(ctx, glob, glob, batch_pairs(ctx, "train", 1), eta=0.05, lam=2.0, K=3, lr=0.1, l2=l2)
    assert_params_close(new["model"], w)
    assert_params_close(upload["params"], w)
    assert_params_close(new["personal"], theta)
    assert alg.eval_params(new) is new["personal"]


def test_pfedme_l2_option_changes_the_result():
    ctx = tiny_context(n_train=10)
    glob = params_of(ctx, 2)
    a = build("pfedme", ctx).local_train({"global": glob}, {"model": glob, "personal": glob}, ctx)[0]
    b = build("pfedme", ctx, "pfedme.l2=0.001").local_train({"global": glob}, {"model": glob, "personal": glob}, ctx)[0]
    assert differs(a["personal"], b["personal"])


def test_pfedme_server_mixes_with_beta():
    ctx = tiny_context()
    old, a, b = params_of(ctx, 1), params_of(ctx, 2), params_of(ctx, 3)
    uploads = [{"params": a, "num_samples": 10}, {"params": b, "num_samples": 30}]
    half = build("pfedme", ctx, "pfedme.beta=0.5")
    out = half.aggregate({"global": old}, uploads, 1)["global"]
    assert_params_close(out, {k: 0.5 * old[k] + 0.5 * (0.25 * a[k] + 0.75 * b[k]) for k in old})
    quarter = build("pfedme", ctx, "pfedme.beta=0.25")
    out = quarter.aggregate({"global": old}, uploads, 1)["global"]
    assert_params_close(out, {k: 0.75 * old[k] + 0.25 * (0.25 * a[k] + 0.75 * b[k]) for k in old})
    uniform = build("pfedme", ctx, "pfedme.beta=0.5", "pfedme.server_weights='uniform'")
    out = uniform.aggregate({"global": old}, uploads, 1)["global"]
    assert_params_close(out, {k: 0.5 * old[k] + 0.5 * (0.5 * a[k] + 0.5 * b[k]) for k in old})
    full = build("pfedme", ctx).aggregate({"global": old}, uploads, 1)["global"]
    assert_params_close(full, {k: 0.25 * a[k] + 0.75 * b[k] for k in old})


def test_pfedme_with_ala_keeps_theta_start_at_received_global():
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.1)
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    for theta_init in ("received", "local"):
        alg = build(
            "pfedme+ala", ctx, "fedala.max_start_epochs=3", "pfedme.inner_steps=2", f"pfedme.theta_init='{theta_init}'"
        )
        state, _ = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)
        w0 = state["model"]  # ALA's initialisation of the local w
        assert differs(w0, glob)
        new = alg.local_train({"global": glob}, state, ctx)[0]
        start = glob if theta_init == "received" else w0
        w, theta = pfedme_by_hand(ctx, w0, start, batch_pairs(ctx, "train", 1), eta=0.01, lam=15.0, K=2, lr=0.1)
        assert_params_close(new["model"], w)
        assert_params_close(new["personal"], theta)


# ---- against PFLlib f1e313a -------------------------------------------------------------------


def pfllib_pfedme_client(
    ctx, glob: dict, lr: float, plr: float, lam: float, K: int, mu: float = 0.001
) -> tuple[dict, dict]:
    """clientpFedMe.py ``train`` with fedoptimizer.py ``pFedMeOptimizer`` (its mu = 0.001 default,
    never overridden by the client). theta lives in the model's parameters, starts at the received
    global (``set_parameters``) and persists across batches and epochs; w = ``local_params`` starts
    at the received global too. Per batch: K times {CE backward at theta; theta <- theta - plr *
    (grad + lam (theta - w) + mu theta)}; then w <- w - lam * lr * (w - theta). The model is finally
    overwritten with w, which is uploaded."""
    net = network(ctx, glob)
    w = {k: v.clone() for k, v in glob.items()}
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        for _ in range(K):
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
            with torch.no_grad():
                for k, theta in net.named_parameters():
                    theta.copy_(theta - plr * (theta.grad + lam * (theta - w[k]) + mu * theta))
        with torch.no_grad():
            for k, theta in net.named_parameters():
                w[k] = w[k] - lam * lr * (w[k] - theta)
    return w, weights(net)


def pfllib_pfedme_server(previous: dict, models: list[dict], train_samples: list[int], beta: float) -> dict:
    """serverpFedMe.py: keep the previous global, FedAvg-aggregate (serverbase), then
    ``beta_aggregate_parameters``: (1 - beta) * previous + beta * aggregate."""
    avg = pfllib_server_average(models, train_samples)
    return {k: (1 - beta) * previous[k] + beta * avg[k] for k in avg}


def test_pfedme_is_pfllib_inner_steps_with_its_l2_term_local_update_and_beta_server():
    ctxs = [tiny_context(n_train=30, seed=0, epochs=2), tiny_context(n_train=20, seed=1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    lam, plr, K, beta = 15.0, 0.01, 5, 0.5
    # pflkit's default l2 = 0 drops the reference's 0.001 * theta (documented); l2 = 0.001 restores it
    alg, server, states, uploads = two_client_round(
        "pfedme",
        ctxs,
        glob,
        f"pfedme.lam={lam}",
        f"pfedme.personal_lr={plr}",
        f"pfedme.inner_steps={K}",
        f"pfedme.beta={beta}",
        "pfedme.l2=0.001",
    )
    assert alg.settings.server_weights == "samples" and alg.settings.theta_init == "received"
    expected_w, expected_theta = [], []
    for ctx, state, upload in zip(ctxs, states, uploads):
        w, theta = pfllib_pfedme_client(ctx, glob, lr=0.1, plr=plr, lam=lam, K=K)
        assert_params_close(state["model"], w)
        assert_params_close(upload["params"], w)
        assert_params_close(state["personal"], theta)  # pflkit scores theta (documented: PFLlib scores the global)
        expected_w.append(w)
        expected_theta.append(theta)
    assert moved(expected_w[0], expected_theta[0]) and moved(expected_w[0], glob)
    assert_params_close(server["global"], pfllib_pfedme_server(glob, expected_w, [30, 20], beta))

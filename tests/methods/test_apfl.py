"""APFL: against my step-by-step transcription of Algorithm 1 of Deng et al. (2020), and a pinned
difference from my transcription of PFLlib f1e313a (``clients/clientapfl.py``: ``train``,
``alpha_update``; ``servers/serverapfl.py``)."""

from __future__ import annotations

import numpy as np
import torch

from tests.support.builders import batch_pairs, build, client_context, params_of, tiny_context
from tests.support.checks import assert_params_close, moved
from tests.support.references import XFAIL_DIFFERS, grads, network, pfllib_server_average, weights


def paper_apfl_client(ctx, w, v, alpha, lr, alpha_lr, alpha_decay=0.0):
    """Algorithm 1, per batch xi: w' = w - lr grad f(w; xi); with v_bar = alpha v + (1 - alpha) w and
    g = grad f(v_bar; xi): v' = v - lr alpha g (the gradient in v); alpha' = alpha - alpha_lr <v - w, g>
    (the gradient in alpha; ``alpha_decay``: plus alpha_decay * alpha), projected to [0, 1]. All at
    the values before the step."""
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        g_w = grads(ctx.model, w, x, y)
        v_bar = {k: alpha * v[k] + (1 - alpha) * w[k] for k in w}
        g = grads(ctx.model, v_bar, x, y)
        g_alpha = sum(float(((v[k] - w[k]) * g[k]).sum()) for k in w) + alpha_decay * alpha
        w, v = {k: w[k] - lr * g_w[k] for k in w}, {k: v[k] - lr * alpha * g[k] for k in v}
        alpha = float(np.clip(alpha - alpha_lr * g_alpha, 0.0, 1.0))
    return w, v, alpha


def client_round(alg, ctx, glob, v, alpha):
    state = {**alg.init_client(params_of(ctx, 9), 0), "personal": v, "alpha": torch.tensor(alpha)}
    state, _ = alg.local_init({"global": glob}, state, ctx)
    return state, *alg.local_train({"global": glob}, state, ctx)


def test_apfl_is_algorithm_1_of_the_paper_step_by_step():
    ctxs = [tiny_context(n_train=30, seed=0, epochs=2), tiny_context(n_train=20, seed=1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    alg = build("apfl", ctxs[0])
    assert float(alg.init_client(glob, 0)["alpha"]) == 0.5
    uploads, refs = [], []
    for i, ctx in enumerate(ctxs):
        v, alpha = params_of(ctx, 3 + i), 0.3
        state, new, upload, metrics = client_round(alg, ctx, glob, v, alpha)
        # scored: alpha v + (1 - alpha) w, w the received global
        assert_params_close(alg.eval_params(state), {k: alpha * v[k] + (1 - alpha) * glob[k] for k in glob})
        ref_w, ref_v, ref_alpha = paper_apfl_client(ctx, glob, v, alpha, lr=0.1, alpha_lr=0.1)
        assert_params_close(new["model"], ref_w)
        assert_params_close(new["personal"], ref_v)
        torch.testing.assert_close(float(new["alpha"]), ref_alpha, rtol=1e-4, atol=1e-6)
        assert abs(ref_alpha - alpha) > 1e-4  # alpha learns
        assert_params_close(upload["params"], ref_w)  # w travels, v and alpha stay
        uploads.append({**upload, "client_id": i})
        refs.append(ref_w)
    out = alg.aggregate(alg.init_server(glob), uploads, 1)
    assert_params_close(out["global"], pfllib_server_average(refs, [30, 20]))  # FedAvg's server


def test_apfl_options_fix_alpha_and_add_the_references_alpha_term():
    ctx = tiny_context(n_train=30, seed=0)
    glob, v = params_of(ctx, 2), params_of(ctx, 3)
    fixed = build("apfl", ctx, "apfl.alpha_lr=0.0")
    _, new, _, _ = client_round(fixed, ctx, glob, v, 0.3)
    assert torch.equal(new["alpha"], torch.tensor(0.3))
    ref_w, ref_v, _ = paper_apfl_client(ctx, glob, v, 0.3, lr=0.1, alpha_lr=0.0)
    assert_params_close(new["personal"], ref_v)
    decayed = build("apfl", ctx, "apfl.alpha_decay=0.02", "apfl.alpha_lr=0.5")
    _, new, _, _ = client_round(decayed, ctx, glob, v, 0.3)
    _, ref_v, ref_alpha = paper_apfl_client(ctx, glob, v, 0.3, lr=0.1, alpha_lr=0.5, alpha_decay=0.02)
    torch.testing.assert_close(float(new["alpha"]), ref_alpha, rtol=1e-4, atol=1e-6)
    assert_params_close(new["personal"], ref_v)
    _, _, plain_alpha = paper_apfl_client(ctx, glob, v, 0.3, lr=0.1, alpha_lr=0.5)
    assert abs(plain_alpha - ref_alpha) > 1e-4  # the term matters
    steep = build("apfl", ctx, "apfl.alpha_lr=50.0")
    ends = []
    for start in (0.02, 0.5, 0.98):  # a large alpha lr drives alpha to a bound: the projection
        _, new, _, _ = client_round(steep, ctx, glob, v, start)
        _, ref_v, ref_alpha = paper_apfl_client(ctx, glob, v, start, lr=0.1, alpha_lr=50.0)
        torch.testing.assert_close(float(new["alpha"]), ref_alpha, rtol=1e-4, atol=1e-6)
        assert_params_close(new["personal"], ref_v)
        ends.append(ref_alpha)
    assert {0.0, 1.0} & set(ends)


def paper_apfl_client_with_momentum(ctx, w, v, alpha, lr, alpha_lr, momentum, weight_decay):
    """``paper_apfl_client`` with w and v stepped by SGD with momentum and weight decay (torch's rule:
    d = grad + wd p, b = momentum b + d, from b = d at the first step; p -= lr b), alpha by plain
    SGD, as the paper's scalar step."""
    buf: dict = {}

    def step(name, p, grad):
        d = grad + weight_decay * p
        buf[name] = d if name not in buf else momentum * buf[name] + d
        return p - lr * buf[name]

    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        g_w = grads(ctx.model, w, x, y)
        v_bar = {k: alpha * v[k] + (1 - alpha) * w[k] for k in w}
        g = grads(ctx.model, v_bar, x, y)
        g_alpha = sum(float(((v[k] - w[k]) * g[k]).sum()) for k in w)
        w, v = {k: step(("w", k), w[k], g_w[k]) for k in w}, {k: step(("v", k), v[k], alpha * g[k]) for k in v}
        alpha = float(np.clip(alpha - alpha_lr * g_alpha, 0.0, 1.0))
    return w, v, alpha


def test_apfl_steps_alpha_by_plain_sgd_under_the_runs_momentum_and_weight_decay():
    ctx = client_context(0, n_train=40, lr=0.05, momentum=0.9, weight_decay=0.01, rounds=1)
    glob, v = params_of(ctx, 2), params_of(ctx, 3)
    alg = build("apfl", ctx, "apfl.alpha_lr=0.5")
    _, new, _, _ = client_round(alg, ctx, glob, v, 0.4)
    ref_w, ref_v, ref_alpha = paper_apfl_client_with_momentum(ctx, glob, v, 0.4, 0.05, 0.5, 0.9, 0.01)
    assert_params_close(new["model"], ref_w)
    assert_params_close(new["personal"], ref_v)
    torch.testing.assert_close(float(new["alpha"]), ref_alpha, rtol=1e-4, atol=1e-6)
    _, _, plain = paper_apfl_client(ctx, glob, v, 0.4, lr=0.05, alpha_lr=0.5)
    assert abs(plain - ref_alpha) > 1e-4  # momentum on w and v changes alpha's path: the case is not trivial


def pfllib_apfl_client(ctx, glob, v, alpha, lr):
    """clientapfl.py ``train``: per batch, an SGD step of the model on CE(model(x)), then of model_per
    on CE(model_per(x)); ``alpha_update``: grad = sum over tensors of (v - w) . (alpha grad_v +
    (1 - alpha) grad_w) + 0.02 alpha with the stepped v and w; alpha -= lr grad, clipped. After the
    epochs model_per becomes (1 - alpha) w + alpha v."""
    model, model_per = network(ctx, glob), network(ctx, v)
    opt, opt_per = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(model_per.parameters(), lr=lr)
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        for net, o in ((model, opt), (model_per, opt_per)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            o.step()
        g = sum(
            float((p.data - w.data).flatten() @ (alpha * p.grad + (1 - alpha) * w.grad).flatten())
            for w, p in zip(model.parameters(), model_per.parameters())
        )
        alpha = float(np.clip(alpha - lr * (g + 0.02 * alpha), 0.0, 1.0))
    w = weights(model)
    return w, {k: (1 - alpha) * w[k] + alpha * p for k, p in weights(model_per).items()}, alpha


@XFAIL_DIFFERS(reason="PFLlib steps v on its own loss and then replaces it by the mixture")
def test_apfl_personal_step_is_pfllibs():
    """PFLlib steps v on its own loss and replaces it by the mixture after training; the paper (and
    pflkit) steps v on the mixture's loss and keeps it."""
    ctx = tiny_context(n_train=30, seed=0)
    glob, v = params_of(ctx, 2), params_of(ctx, 3)
    alg = build("apfl", ctx, "apfl.alpha_decay=0.02")
    _, new, _, _ = client_round(alg, ctx, glob, v, 0.5)
    ref_w, ref_v, _ = pfllib_apfl_client(ctx, glob, v, 0.5, lr=0.1)
    assert_params_close(new["model"], ref_w)  # w's step is the same
    assert moved(ref_v, v)
    assert_params_close(new["personal"], ref_v)


def test_apfl_on_batch_norm_keeps_the_personal_models_statistics_its_own_on_every_context():
    """The personal model v's running statistics travel in the fit under APFL's prefix: training
    moves them, the caller's tensors stay untouched, and the batched context (clients not in size
    order, so it runs them reordered) gives each client what it gives alone."""
    import copy

    from pflkit.algorithms import TrainSettings
    from pflkit.config import load_config
    from pflkit.data.federated import ClientData, FederatedData
    from pflkit.engines import SingleClientContext
    from pflkit.engines.batched import BatchedClientContext
    from pflkit.engines.stacking import stack, unstack
    from pflkit.methods import build_algorithm
    from pflkit.models import build_model

    torch.manual_seed(0)
    model = build_model("fedbn_cnn", (1, 8, 8), 10)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    init.update({k: b.detach().clone() for k, b in model.named_buffers() if b.is_floating_point()})
    g = torch.Generator().manual_seed(1)
    clients = []
    for k, n in enumerate([30, 50]):  # the smaller first: the batched context reorders them
        x, y = torch.randn(n + 4, 1, 8, 8, generator=g) * (1 + k), torch.randint(0, 10, (n + 4,), generator=g)
        clients.append(ClientData(k, x[:n], y[:n], x[n:], y[n:]))
    data = FederatedData.from_clients(clients, 10, "toy")
    train = TrainSettings(batch_size=10, local_epochs=1, lr=0.01)
    alg = build_algorithm("apfl", load_config(None, []).algorithm_sections(), train, model.units())
    payload = {"global": {k: init[k] for k in alg.parameter_names}}
    states = [alg.init_client(init, k) for k in range(2)]
    kept = copy.deepcopy(states)
    stat = "bn1.running_mean"
    alone = []
    for k in range(2):
        ctx = SingleClientContext(k, 1, 0, data.client(k), model, model.units(), train, "apfl")
        state, _ = alg.local_init(payload, states[k], ctx)
        new, _, _ = alg.local_train(payload, state, ctx)
        assert moved({stat: new["personal"][stat]}, {stat: init[stat]})
        assert torch.equal(states[k]["personal"][stat], kept[k]["personal"][stat])  # the caller's: untouched
        alone.append(new)
    bctx = BatchedClientContext([0, 1], 1, 0, data, model, model.units(), train, "apfl")
    cpu = torch.device("cpu")
    stacked = {
        "model": stack([s["model"] for s in kept], cpu),
        "personal": stack([s["personal"] for s in kept], cpu),
        "alpha": torch.stack([s["alpha"] for s in kept]),
    }
    down = {"global": stack([payload["global"]] * 2, cpu)}
    state, _ = alg.local_init(down, stacked, bctx)
    new, _, _ = alg.local_train(down, state, bctx)
    # Float reassociation in the vmapped batch norm grows through training: at lr 0.01 at most 5.3e-5
    # (measured over AVX2 and generic kernels, one and two threads; at lr 0.05 up to 1e-2). Dropping
    # the statistics' updates moves them by 9e-2 or more.
    for k in range(2):
        assert_params_close(unstack(new["personal"], k, kept[k]["personal"]), alone[k]["personal"], atol=1e-3)
        assert_params_close(unstack(new["model"], k, kept[k]["model"]), alone[k]["model"], atol=1e-3)

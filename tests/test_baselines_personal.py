"""Golden tests of Per-FedAvg, pFedMe, FedPHP and PartialFed (spec §2.4, 2.6, 2.9, 2.12).

Every update rule is recomputed here by hand with plain torch (functional_call on the model,
autograd) on the algorithm's documented batch streams and compared with what the algorithm
produced.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call
from torch.nn import functional as F

from pflkit.algorithms.fedphp import hpm_coefficient, kd_loss, mmd_rbf
from pflkit.algorithms.partialfed import gumbel_noise, mix_units, select_units, temperature
from pflkit.config import load_config
from pflkit.data.federated import ClientData, FederatedData
from pflkit.engines import ClientJob, RoundSetup, run_client
from pflkit.functional import NonFiniteLossError, evaluate
from pflkit.methods import build_algorithm
from pflkit.models import build_model

from helpers import batch_pairs, params_of, tiny_context

torch.set_num_threads(1)
METHODS = ["perfedavg", "pfedme", "fedphp", "partialfed"]


def build(name: str, ctx, *overrides: str):
    cfg = load_config(None, ["fedala.max_start_epochs=3", *overrides])
    return build_algorithm(name, cfg.algorithm_sections(), ctx.train, ctx.units)


def ce(model, params, x, y):
    return F.cross_entropy(functional_call(model, params, (x,)), y)


def grads(model, params, x, y, loss_fn=None):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = (loss_fn or ce)(model, leaves, x, y)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def step(params, g, lr):
    return {k: params[k] - lr * g[k] for k in params}


def assert_params_close(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


def differs(a, b) -> bool:
    return any(not torch.allclose(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- Per-FedAvg (§2.4)

def test_perfedavg_defaults_alpha_beta_to_local_lr():
    ctx = tiny_context(lr=0.07)
    alg = build("perfedavg", ctx)
    assert alg.alpha == 0.07 and alg.beta == 0.07
    alg = build("perfedavg", ctx, "perfedavg.alpha=0.3", "perfedavg.beta=0.2")
    assert alg.alpha == 0.3 and alg.beta == 0.2


def test_perfedavg_first_order_steps_on_independent_batches():
    ctx = tiny_context(n_train=20, batch_size=10, lr=0.1)
    alg = build("perfedavg", ctx, "perfedavg.alpha=0.3", "perfedavg.beta=0.2", "perfedavg.clip_norm=0")
    w0 = params_of(ctx, 2)
    new, upload, metrics = alg.local_train({"global": w0}, {"model": w0}, ctx)
    w = dict(w0)
    for (xb, yb), (xo, yo) in zip(batch_pairs(ctx, "train", 1), batch_pairs(ctx, "outer", 1)):
        w_prime = step(w, grads(ctx.model, w, xb, yb), 0.3)
        w = step(w, grads(ctx.model, w_prime, xo, yo), 0.2)
    assert_params_close(new["model"], w)
    assert_params_close(upload["params"], w)
    assert "eval" not in new and metrics["train_loss"] > 0


def test_perfedavg_clips_the_meta_gradient_before_the_beta_step():
    ctx = tiny_context(n_train=20, batch_size=10, lr=0.1)
    alg = build("perfedavg", ctx, "perfedavg.alpha=0.3", "perfedavg.beta=0.2", "perfedavg.clip_norm=0.05")
    w0 = params_of(ctx, 2)
    new = alg.local_train({"global": w0}, {"model": w0}, ctx)[0]["model"]
    w = dict(w0)
    clipped = 0
    for (xb, yb), (xo, yo) in zip(batch_pairs(ctx, "train", 1), batch_pairs(ctx, "outer", 1)):
        w_prime = step(w, grads(ctx.model, w, xb, yb), 0.3)
        g = grads(ctx.model, w_prime, xo, yo)
        norm = math.sqrt(sum(float((v ** 2).sum()) for v in g.values()))
        coef = min(1.0, 0.05 / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_
        clipped += coef < 1
        w = step(w, {k: coef * v for k, v in g.items()}, 0.2)
    assert clipped == 2  # it really engaged
    assert_params_close(new, w)
    assert build("perfedavg", ctx).settings.clip_norm == 10.0  # the default safety net


def test_perfedavg_split_pairs_are_halves_of_a_double_batch():
    ctx = tiny_context(n_train=20, batch_size=5, lr=0.1)
    alg = build("perfedavg", ctx, "perfedavg.batch_pairs='split'", "perfedavg.alpha=0.3", "perfedavg.beta=0.2",
                "perfedavg.clip_norm=0")
    w0 = params_of(ctx, 2)
    new = alg.local_train({"global": w0}, {"model": w0}, ctx)[0]["model"]
    order = torch.randperm(20, generator=ctx.generator("train"))
    w = dict(w0)
    x, y = ctx.data.train_x, ctx.data.train_y
    for pair in (order[:10], order[10:]):  # 20 // (2 * 5) = 2 steps
        first, second = pair[:5], pair[5:]
        w_prime = step(w, grads(ctx.model, w, x[first], y[first]), 0.3)
        w = step(w, grads(ctx.model, w_prime, x[second], y[second]), 0.2)
    assert_params_close(new, w)


def test_perfedavg_hessian_free_uses_a_hessian_vector_product():
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.1)
    alg = build("perfedavg", ctx, "perfedavg.hessian_free=true", "perfedavg.alpha=0.3", "perfedavg.beta=0.2")
    w0 = params_of(ctx, 2)
    new = alg.local_train({"global": w0}, {"model": w0}, ctx)[0]["model"]
    (xb, yb), (xo, yo), (xh, yh) = (batch_pairs(ctx, p, 1)[0] for p in ("train", "outer", "hessian"))
    names = list(w0)
    w_prime = step(w0, grads(ctx.model, w0, xb, yb), 0.3)
    g_outer = grads(ctx.model, w_prime, xo, yo)

    def loss_of(*tensors):
        return ce(ctx.model, dict(zip(names, tensors)), xh, yh)

    _, hv = torch.autograd.functional.hvp(loss_of, tuple(w0[k] for k in names), tuple(g_outer[k] for k in names))
    expected = {k: w0[k] - 0.2 * (g_outer[k] - 0.3 * h) for k, h in zip(names, hv)}
    assert_params_close(new, expected, rtol=1e-4, atol=1e-6)
    first_order = build("perfedavg", ctx, "perfedavg.alpha=0.3", "perfedavg.beta=0.2")
    assert differs(new, first_order.local_train({"global": w0}, {"model": w0}, ctx)[0]["model"])


def test_perfedavg_evaluates_one_alpha_step_from_the_received_model():
    ctx = tiny_context(n_train=20, batch_size=10, lr=0.1)
    alg = build("perfedavg", ctx, "perfedavg.alpha=0.3")
    glob = params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(params_of(ctx, 1), 0), ctx)
    assert_params_close(state["model"], glob, rtol=0, atol=0)  # the step is not kept for training
    xa, ya = batch_pairs(ctx, "adapt", 1)[0]
    assert_params_close(alg.eval_params(state), step(glob, grads(ctx.model, glob, xa, ya), 0.3))


def test_perfedavg_with_ala_adapts_the_ala_initialised_model():
    ctx = tiny_context(n_train=20, batch_size=10, lr=0.1)
    alg = build("perfedavg+ala", ctx, "perfedavg.alpha=0.3")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    state, info = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)  # round 1: local != global
    assert differs(state["model"], glob) and info["ala_epochs"] > 0
    xa, ya = batch_pairs(ctx, "adapt", 1)[0]
    init = state["model"]
    assert_params_close(alg.eval_params(state), step(init, grads(ctx.model, init, xa, ya), 0.3))


# ---------------------------------------------------------------- pFedMe (§2.6)

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
    alg = build("pfedme", ctx, "pfedme.personal_lr=0.05", "pfedme.lam=2.0", "pfedme.inner_steps=3",
                f"pfedme.l2={l2}")
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
    b = build("pfedme", ctx, "pfedme.l2=0.001").local_train({"global": glob}, {"model": glob, "personal": glob},
                                                             ctx)[0]
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
        alg = build("pfedme+ala", ctx, "pfedme.inner_steps=2", f"pfedme.theta_init='{theta_init}'")
        state, _ = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)
        w0 = state["model"]  # ALA's initialisation of the local w
        assert differs(w0, glob)
        new = alg.local_train({"global": glob}, state, ctx)[0]
        start = glob if theta_init == "received" else w0
        w, theta = pfedme_by_hand(ctx, w0, start, batch_pairs(ctx, "train", 1), eta=0.01, lam=15.0, K=2, lr=0.1)
        assert_params_close(new["model"], w)
        assert_params_close(new["personal"], theta)


# ---------------------------------------------------------------- FedPHP (§2.9)

def test_mmd_matches_the_pairwise_definition():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, generator=g) * 3, torch.randn(4, 3, generator=g) * 3 + 1

    def k(a, b):
        return sum(math.exp(-float(((a - b) ** 2).sum()) / (2 * s)) for s in (10, 15, 20, 50))

    n = len(x)
    expected = sum(k(x[i], x[j]) + k(y[i], y[j]) - 2 * k(x[i], y[j]) for i in range(n) for j in range(n)) / n ** 2
    assert mmd_rbf(x, y, [10, 15, 20, 50]).item() == pytest.approx(expected, rel=1e-5)
    assert mmd_rbf(x, x, [10, 15, 20, 50]).item() == pytest.approx(0.0, abs=1e-6)
    assert mmd_rbf(x.view(4, 3, 1), y.view(4, 1, 3), [10, 15, 20, 50]).item() == pytest.approx(expected, rel=1e-5)


def test_kd_loss_is_scaled_kl_from_teacher_to_student():
    s, t = torch.tensor([[1.0, 2.0, 0.5]]), torch.tensor([[0.2, 0.1, 3.0]])
    p_t, p_s = torch.softmax(t / 2, 1), torch.softmax(s / 2, 1)
    expected = 4 * float((p_t * (p_t.log() - p_s.log())).sum())
    assert kd_loss(s, t, 2.0).item() == pytest.approx(expected, rel=1e-5)


def test_hpm_coefficient_grows_linearly_to_mu():
    assert hpm_coefficient(0.9, 1, 4) == pytest.approx(0.225)
    assert hpm_coefficient(0.9, 4, 4) == pytest.approx(0.9)
    assert hpm_coefficient(0.9, 5, 4) == pytest.approx(0.9)  # capped at T


def test_fedphp_step_with_mmd_and_hpm_update():
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.1, round=1)
    ctx.train = ctx.train.model_copy(update={"rounds": 4})
    alg = build("fedphp", ctx, "fedphp.lam=0.5")
    glob, hpm = params_of(ctx, 2), params_of(ctx, 3)
    state = {**alg.init_client(params_of(ctx, 1), 0), "hpm": hpm}
    state, _ = alg.local_init({"global": glob}, state, ctx)
    new, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    (x, y), = batch_pairs(ctx, "train", 1)
    teacher = functional_call(ctx.model, hpm, (x,), {"stop": 3}).detach()

    def loss_fn(model, params, x, y):
        feats = functional_call(model, params, (x,), {"stop": 3})
        logits = functional_call(model, params, (feats,), {"start": 3})
        return 0.5 * F.cross_entropy(logits, y) + 0.5 * mmd_rbf(feats, teacher, [10, 15, 20, 50])

    w = step(glob, grads(ctx.model, glob, x, y, loss_fn), 0.1)
    assert_params_close(new["model"], w)
    assert_params_close(upload["params"], w)
    mu_t = 0.9 * 1 / 4
    assert_params_close(new["hpm"], {k: mu_t * hpm[k] + (1 - mu_t) * w[k] for k in w})
    assert metrics["hpm_mu"] == pytest.approx(mu_t)
    # the trained w is what the next evaluation scores, also after a new model arrives
    nxt, _ = alg.local_init({"global": params_of(ctx, 4)}, new, ctx)
    assert_params_close(alg.eval_params(nxt), w)
    hpm_eval = build("fedphp", ctx, "fedphp.eval_hpm=true")
    assert hpm_eval.eval_params(nxt) is nxt["hpm"]


def pfllib_mmd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """My transcription of PFLlib's clientphp.py MMD (kernel "rbf"): squared distances
    ||a||^2 + ||b||^2 - 2 a.b without a clamp, K = sum over a in {10, 15, 20, 50} of exp(-D / (2a)),
    the mean of K_xx + K_yy - 2 K_xy over the b x b matrix."""
    def sq(a, b):
        return (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.t()

    def k(d):
        return sum(torch.exp(-d / (2 * a)) for a in (10, 15, 20, 50))
    return (k(sq(x, x)) + k(sq(y, y)) - 2 * k(sq(x, y))).mean()


def test_fedphp_pfllib2022_blends_on_receive_scores_the_blend_and_distils_toward_the_global_model():
    """PFLlib's FedPHP at FedALA's time (TsingZ0/PFLlib f1e313a clientphp.py set_parameters and train):
    w <- (1 - mu_R) global + mu_R w_old with mu_R = mu * R / T, R counted from 0; scored before
    training; loss (1 - lam) CE(w) + lam MMD(fc1 features of w, of the global model)."""
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.1, round=3)
    ctx.train = ctx.train.model_copy(update={"rounds": 4})
    alg = build("fedphp", ctx, "fedphp.lam=0.5", "fedphp.variant='pfllib2022'")
    glob, old = params_of(ctx, 2), params_of(ctx, 1)
    state = {**alg.init_client(old, 0)}
    state, info = alg.local_init({"global": glob}, state, ctx)
    mu_r = 0.9 * 2 / 4  # round 3 is PFLlib's R = 2
    assert info["hpm_mu"] == pytest.approx(mu_r)
    blended = {k: (1 - mu_r) * glob[k] + mu_r * old[k] for k in glob}
    assert_params_close(state["model"], blended)
    assert_params_close(alg.eval_params(state), blended)  # scored before training
    new, upload, _ = alg.local_train({"global": glob}, state, ctx)
    (x, y), = batch_pairs(ctx, "train", 1)
    teacher = functional_call(ctx.model, glob, (x,), {"stop": 3}).detach()

    def loss_fn(model, params, x, y):
        feats = functional_call(model, params, (x,), {"stop": 3})
        logits = functional_call(model, params, (feats,), {"start": 3})
        return 0.5 * F.cross_entropy(logits, y) + 0.5 * pfllib_mmd(feats, teacher)

    assert_params_close(new["model"], step(blended, grads(ctx.model, blended, x, y, loss_fn), 0.1))
    first = tiny_context(round=1)
    first.train = first.train.model_copy(update={"rounds": 4})
    state, info = alg.local_init({"global": glob}, alg.init_client(old, 0), first)
    assert info["hpm_mu"] == 0.0 and all(torch.equal(state["model"][k], glob[k]) for k in glob)


@pytest.mark.parametrize("kt", ["mmd", "kd"])
def test_fedphp_without_transfer_is_plain_sgd(kt):
    ctx = tiny_context(n_train=20, batch_size=10, lr=0.1)
    glob = params_of(ctx, 2)
    alg = build("fedphp", ctx, "fedphp.lam=0.0", f"fedphp.kt='{kt}'")
    new = alg.local_train({"global": glob}, {**alg.init_client(glob, 0), "hpm": params_of(ctx, 3)}, ctx)[0]
    w = dict(glob)
    for x, y in batch_pairs(ctx, "train", 1):
        w = step(w, grads(ctx.model, w, x, y), 0.1)
    assert_params_close(new["model"], w)


def test_fedphp_kd_option_distils_logits():
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.1)
    glob, hpm = params_of(ctx, 2), params_of(ctx, 3)
    alg = build("fedphp", ctx, "fedphp.lam=0.5", "fedphp.kt='kd'", "fedphp.temperature=2.0")
    new = alg.local_train({"global": glob}, {**alg.init_client(glob, 0), "hpm": hpm}, ctx)[0]
    (x, y), = batch_pairs(ctx, "train", 1)
    teacher = functional_call(ctx.model, hpm, (x,)).detach()

    def loss_fn(model, params, x, y):
        logits = functional_call(model, params, (x,))
        return 0.5 * F.cross_entropy(logits, y) + 0.5 * kd_loss(logits, teacher, 2.0)

    assert_params_close(new["model"], step(glob, grads(ctx.model, glob, x, y, loss_fn), 0.1))


# ---------------------------------------------------------------- PartialFed (§2.12)

def test_partialfed_gate_materialisation():
    ctx = tiny_context()
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    U = len(ctx.units)
    assert_params_close(select_units(glob, local, [True] * U, ctx.units), glob, rtol=0, atol=0)
    assert_params_close(select_units(glob, local, [False] * U, ctx.units), local, rtol=0, atol=0)
    mixed = select_units(glob, local, [True, False, True, False], ctx.units)
    for u, (_, names) in enumerate(ctx.units):
        for k in names:
            assert torch.equal(mixed[k], (glob if u % 2 == 0 else local)[k])
    gates = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.25, 0.75], [0.5, 0.5]])
    soft = mix_units(glob, local, gates, ctx.units)
    for u, (_, names) in enumerate(ctx.units):
        for k in names:
            torch.testing.assert_close(soft[k], gates[u, 0] * glob[k] + gates[u, 1] * local[k])


def test_partialfed_temperature_schedule():
    assert temperature(5.0, 0.965, 0.05, 1) == pytest.approx(5.0 * 0.965)
    assert temperature(5.0, 0.965, 0.05, 10) == pytest.approx(5.0 * 0.965 ** 10)
    assert temperature(5.0, 0.965, 0.05, 300) == 0.05


def test_partialfed_keeps_the_local_model_on_receipt():
    ctx = tiny_context()
    alg = build("partialfed", ctx, "partialfed.load=batch")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)
    assert_params_close(state["model"], local, rtol=0, atol=0)
    assert torch.equal(state["strategy"], torch.zeros(len(ctx.units), 2))
    assert alg.eval_params(state) is state["model"]


def test_partialfed_round_load_is_one_partial_initialisation():
    """load="round" (default): local_init loads the units of one hard Gumbel draw from S (the
    "init" stream) from the global model into the kept local model; that is the scored model."""
    ctx = tiny_context()
    alg = build("partialfed", ctx)
    assert alg.settings.load == "round"
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    state, metrics = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)
    S = torch.zeros(len(ctx.units), 2)
    use_global = ((S + gumbel_noise(ctx.generator("init"), S.shape)).argmax(1) == 0).tolist()
    assert 0 < sum(use_global) < len(ctx.units)  # this draw mixes both kinds of unit
    assert_params_close(state["model"], select_units(glob, local, use_global, ctx.units), rtol=0, atol=0)
    assert_params_close(state["init_local"], local, rtol=0, atol=0)
    assert metrics["global_picks"] == pytest.approx(sum(use_global) / len(ctx.units))
    assert alg.eval_params(state) is state["model"]
    for sign, expected in ((1.0, glob), (-1.0, local)):
        forced = {**alg.init_client(local, 0), "strategy": torch.tensor([[50.0, -50.0]] * len(ctx.units)) * sign}
        state, _ = alg.local_init({"global": glob}, forced, ctx)
        assert_params_close(state["model"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("to_global", [True, False])
def test_partialfed_round_load_trains_every_model_batch_from_the_initialisation(to_global):
    """The loaded units are not copied from the global model again before later batches: three model
    batches are three plain SGD steps from the partially initialised model (per-batch reloading from
    the fixed global kept only the last step of every reloaded unit: the round's training was lost)."""
    ctx = tiny_context(n_train=30, batch_size=10, lr=0.1)
    alg = build("partialfed", ctx, "partialfed.model_batches=1", "partialfed.strategy_batches=0")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    sign = 1.0 if to_global else -1.0
    state = {**alg.init_client(local, 0), "strategy": torch.tensor([[50.0, -50.0]] * len(ctx.units)) * sign}
    state, _ = alg.local_init({"global": glob}, state, ctx)
    new, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    work = dict(glob if to_global else local)
    for x, y in batch_pairs(ctx, "train", 1):
        work = step(work, grads(ctx.model, work, x, y), 0.1)
    assert_params_close(new["model"], work)
    assert_params_close(upload["params"], work)
    assert "init_local" not in new and torch.equal(new["strategy"], state["strategy"])
    if to_global:  # load="batch" re-copies the global before every batch: only the last step is left
        batch = build("partialfed", ctx, "partialfed.model_batches=1", "partialfed.strategy_batches=0",
                      "partialfed.load=batch")
        old = batch.local_train({"global": glob}, {"model": local, "strategy": state["strategy"]}, ctx)[0]
        (x, y) = batch_pairs(ctx, "train", 1)[-1]
        assert_params_close(old["model"], step(glob, grads(ctx.model, glob, x, y), 0.1))
        assert differs(old["model"], work)


def test_partialfed_round_load_strategy_batch_mixes_the_initialisation_candidates():
    """f_m=2, f_s=1 with load="round": two plain SGD steps from the initialised model, then one
    strategy step on the mixture of the received global and the kept local model."""
    ctx = tiny_context(n_train=30, batch_size=10, lr=0.1, round=1)
    alg = build("partialfed", ctx, "partialfed.model_batches=2", "partialfed.strategy_batches=1")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)
    new, _, metrics = alg.local_train({"global": glob}, state, ctx)
    S = torch.zeros(len(ctx.units), 2)
    noise = ctx.generator("gates")
    batches = batch_pairs(ctx, "train", 1)
    work = dict(state["model"])
    for x, y in batches[:2]:
        torch.rand(S.shape, generator=noise)  # one draw per batch, model batches too
        work = step(work, grads(ctx.model, work, x, y), 0.1)
    expected_S = strategy_step_by_hand(ctx, glob, local, S, noise, 5.0 * 0.965, 0.1, *batches[2])
    assert_params_close(new["model"], work)
    torch.testing.assert_close(new["strategy"], expected_S, rtol=1e-5, atol=1e-7)
    assert "global_picks" not in metrics  # reported by local_init


@pytest.mark.parametrize("to_global", [True, False])
def test_partialfed_forced_gates_train_from_global_or_local(to_global):
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.1)
    alg = build("partialfed", ctx, "partialfed.model_batches=1", "partialfed.strategy_batches=0",
                "partialfed.load=batch")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    sign = 1.0 if to_global else -1.0
    state = {"model": local, "strategy": torch.tensor([[50.0, -50.0]] * len(ctx.units)) * sign}
    new, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    start = glob if to_global else local
    (x, y), = batch_pairs(ctx, "train", 1)
    expected = step(start, grads(ctx.model, start, x, y), 0.1)
    assert_params_close(new["model"], expected)
    assert_params_close(upload["params"], expected)
    assert torch.equal(new["strategy"], state["strategy"])  # model batches leave S alone
    assert metrics["global_picks"] == (1.0 if to_global else 0.0)


def strategy_step_by_hand(ctx, glob, local, S, noise, tau, lr, x, y):
    g = -torch.log(-torch.log(torch.rand(S.shape, generator=noise)))
    logits = S.clone().requires_grad_(True)
    gates = torch.softmax((logits + g) / tau, dim=1)
    mixed = {}
    for u, (_, names) in enumerate(ctx.units):
        for k in names:
            mixed[k] = gates[u, 0] * glob[k] + gates[u, 1] * local[k]
    (grad,) = torch.autograd.grad(ce(ctx.model, mixed, x, y), [logits])
    return S - lr * grad


def test_partialfed_strategy_batch_changes_only_the_strategy():
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.1, round=3)
    alg = build("partialfed", ctx, "partialfed.model_batches=0", "partialfed.strategy_batches=1",
                "partialfed.strategy_lr=0.5")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    S = torch.tensor([[0.3, -0.2], [0.0, 0.1], [-0.4, 0.4], [1.0, 0.0]])
    new, _, metrics = alg.local_train({"global": glob}, {"model": local, "strategy": S}, ctx)
    assert_params_close(new["model"], local, rtol=0, atol=0)
    tau = 5.0 * 0.965 ** 3
    assert metrics["tau"] == pytest.approx(tau)
    (x, y), = batch_pairs(ctx, "train", 1)
    expected = strategy_step_by_hand(ctx, glob, local, S, ctx.generator("gates"), tau, 0.5, x, y)
    torch.testing.assert_close(new["strategy"], expected, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(new["strategy"], S)


def test_partialfed_cycle_of_model_and_strategy_batches():
    """load="batch", f_m=2, f_s=1 over three batches: two gated model steps, then one strategy step."""
    ctx = tiny_context(n_train=30, batch_size=10, lr=0.1, round=1)
    alg = build("partialfed", ctx, "partialfed.model_batches=2", "partialfed.strategy_batches=1",
                "partialfed.load=batch")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    S = torch.zeros(len(ctx.units), 2)
    new, _, metrics = alg.local_train({"global": glob}, {"model": local, "strategy": S}, ctx)
    noise = ctx.generator("gates")
    batches = batch_pairs(ctx, "train", 1)
    work = dict(local)
    picks = 0
    for x, y in batches[:2]:
        g = -torch.log(-torch.log(torch.rand(S.shape, generator=noise)))
        use_global = ((S + g).argmax(1) == 0).tolist()
        picks += sum(use_global)
        for u, (_, names) in enumerate(ctx.units):
            for k in names:
                work[k] = glob[k] if use_global[u] else work[k]
        work = step(work, grads(ctx.model, work, x, y), 0.1)
    expected_S = strategy_step_by_hand(ctx, glob, work, S, noise, 5.0 * 0.965, 0.1, *batches[2])
    assert_params_close(new["model"], work)
    torch.testing.assert_close(new["strategy"], expected_S, rtol=1e-5, atol=1e-7)
    assert metrics["global_picks"] == pytest.approx(picks / (2 * len(ctx.units)))


@pytest.mark.parametrize("continue_cycle", [True, False])
def test_partialfed_cycle_continues_across_rounds(continue_cycle):
    """Round 1 ends after the two model batches of a (2, 1) cycle; round 2 starts with the strategy
    batch unless the cycle restarts every round."""
    ctx = tiny_context(n_train=20, batch_size=10, lr=0.1)
    alg = build("partialfed", ctx, "partialfed.model_batches=2", "partialfed.strategy_batches=1",
                f"partialfed.continue_cycle={str(continue_cycle).lower()}")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)
    state, _, metrics = alg.local_train({"global": glob}, state, ctx)
    assert int(state["cycle_pos"]) == 2
    assert torch.equal(state["strategy"], torch.zeros(len(ctx.units), 2))  # model batches only so far
    small = tiny_context(n_train=10, batch_size=10, lr=0.1, round=2)
    new, _, metrics = alg.local_train({"global": glob}, state, small)
    if continue_cycle:
        assert metrics["strategy_loss"] > 0 and not torch.equal(new["strategy"], state["strategy"])
        assert_params_close(new["model"], state["model"], rtol=0, atol=0)
        assert int(new["cycle_pos"]) == 0
    else:
        assert metrics["strategy_loss"] == 0 and torch.equal(new["strategy"], state["strategy"])
        assert differs(new["model"], state["model"])


def test_partialfed_with_ala_gates_between_global_and_ala_model():
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.1)
    alg = build("partialfed+ala", ctx, "partialfed.model_batches=1", "partialfed.strategy_batches=0",
                "partialfed.load=batch")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)
    ala_model = state["model"]
    assert differs(ala_model, glob) and differs(ala_model, local)
    state = {**state, "strategy": torch.tensor([[-50.0, 50.0]] * len(ctx.units))}  # all local
    new = alg.local_train({"global": glob}, state, ctx)[0]
    (x, y), = batch_pairs(ctx, "train", 1)
    assert_params_close(new["model"], step(ala_model, grads(ctx.model, ala_model, x, y), 0.1))


def test_partialfed_round_load_with_ala_initialises_from_the_ala_model():
    """load="round" + ALA: the partial initialisation chooses between the global and ALA's model."""
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.1)
    alg = build("partialfed+ala", ctx, "partialfed.model_batches=1", "partialfed.strategy_batches=0")
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    state = {**alg.init_client(local, 0), "strategy": torch.tensor([[-50.0, 50.0]] * len(ctx.units))}  # all local
    state, _ = alg.local_init({"global": glob}, state, ctx)
    ala_model = state["model"]
    assert differs(ala_model, glob) and differs(ala_model, local)
    assert_params_close(state["init_local"], ala_model, rtol=0, atol=0)
    new = alg.local_train({"global": glob}, state, ctx)[0]
    (x, y), = batch_pairs(ctx, "train", 1)
    assert_params_close(new["model"], step(ala_model, grads(ctx.model, ala_model, x, y), 0.1))


# ---------------------------------------------------------------- rounds through run_client

def two_clients() -> FederatedData:
    g = torch.Generator().manual_seed(5)
    means = torch.randn(10, 1, 8, 8, generator=g)
    clients = []
    for i, n in enumerate((20, 14)):
        y = torch.randint(0, 10, (n + 6,), generator=g)
        x = means[y] + 0.5 * torch.randn(n + 6, 1, 8, 8, generator=g)
        clients.append(ClientData(i, x[:n], y[:n], x[n:], y[n:]))
    return FederatedData.from_clients(clients, 10, "toy")


EVAL_KEY = {"perfedavg": "eval", "pfedme": "personal", "fedphp": "trained", "partialfed": "model"}


@pytest.mark.parametrize("name", METHODS + [f"{m}+ala" for m in METHODS])
def test_two_rounds_through_run_client(name):
    base = name.split("+")[0]
    data = two_clients()
    torch.manual_seed(0)
    model = build_model("digits_cnn", (1, 8, 8), 10)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = load_config(None, ["fedala.max_start_epochs=3", "rounds=2", "lr=0.05", "pfedme.inner_steps=2"])
    train = cfg.train
    alg = build_algorithm(name, cfg.algorithm_sections(), train, model.units())
    setup = RoundSetup(alg, data, model, model.units(), train, seed=3)
    server = alg.init_server(init)
    states = {i: alg.init_client(init, i) for i in range(2)}
    for t in (1, 2):
        results = []
        for i in range(2):
            job = ClientJob(i, alg.downlink(server, i, t), states[i], evaluate=True)
            res = run_client(setup, job, t)
            # the evaluated model is the method's "Eval" model after local_init (spec §5.7)
            ctx_state, _ = alg.local_init(job.payload, states[i], _ctx(setup, i, t))
            expected = evaluate(model, ctx_state[EVAL_KEY[base]], data.client(i).test_x, data.client(i).test_y)
            assert res.evaluation == expected
            assert res.upload["num_samples"] == data.client(i).num_train
            assert_params_close(res.upload["params"], res.state["model"], rtol=0, atol=0)
            assert all(torch.isfinite(v).all() for v in res.upload["params"].values())
            if name.endswith("+ala"):
                assert (res.metrics["ala_epochs"] > 0) == (t == 2)  # ALA is idle while global == local
            states[i] = res.state
            results.append(res)
        old = server["global"]
        server = alg.aggregate(server, [{**r.upload, "client_id": r.client_id} for r in results], t)
        assert differs(server["global"], old)
    if base == "fedphp":  # mu_t = mu * t / T with T = config rounds
        assert results[0].metrics["hpm_mu"] == pytest.approx(0.9)


def _ctx(setup, i, t):
    return setup.context(i, t)


# ---------------------------------------------------------------- NaN losses

@pytest.mark.parametrize("name,overrides,stage", [
    ("perfedavg", [], "local training"),
    ("perfedavg", ["perfedavg.hessian_free=true"], "local training"),
    ("pfedme", [], "personalised inner steps"),
    ("fedphp", [], "knowledge transfer"),
    ("fedphp", ["fedphp.kt='kd'"], "knowledge transfer"),
    ("partialfed", [], "model batches"),
    ("partialfed", ["partialfed.model_batches=0"], "strategy training"),
])
def test_nan_loss_raises_naming_the_stage(name, overrides, stage):
    ctx = tiny_context(n_train=10)
    ctx.data.train_x[3] = float("nan")
    alg = build(name, ctx, *overrides)
    glob = params_of(ctx, 2)
    with pytest.raises(NonFiniteLossError, match=stage):
        alg.local_train({"global": glob}, alg.init_client(glob, 0), ctx)


def test_perfedavg_nan_in_adaptation_step_names_the_stage():
    ctx = tiny_context(n_train=10)
    ctx.data.train_x[0] = float("nan")
    alg = build("perfedavg", ctx)
    with pytest.raises(NonFiniteLossError, match="one-step adaptation"):
        alg.local_init({"global": params_of(ctx, 2)}, alg.init_client(params_of(ctx, 1), 0), ctx)

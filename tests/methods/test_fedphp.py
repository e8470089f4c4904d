"""FedPHP (docs/reference/methods/fedphp.md): MMD, the distillation loss, the HPM schedule and every
update rule recomputed by hand, and PFLlib's 2022 variant (TsingZ0/PFLlib f1e313a
``clientphp.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call
from torch.nn import functional as F

from pflkit.algorithms.fedphp import hpm_coefficient, kd_loss, mmd_rbf
from tests.support.builders import batch_pairs, build, params_of, tiny_context
from tests.support.checks import assert_params_close
from tests.support.references import grads, step


def test_mmd_matches_the_pairwise_definition():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, generator=g) * 3, torch.randn(4, 3, generator=g) * 3 + 1

    def k(a, b):
        return sum(math.exp(-float(((a - b) ** 2).sum()) / (2 * s)) for s in (10, 15, 20, 50))

    n = len(x)
    expected = sum(k(x[i], x[j]) + k(y[i], y[j]) - 2 * k(x[i], y[j]) for i in range(n) for j in range(n)) / n**2
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
    ((x, y),) = batch_pairs(ctx, "train", 1)
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
    ((x, y),) = batch_pairs(ctx, "train", 1)
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
    ((x, y),) = batch_pairs(ctx, "train", 1)
    teacher = functional_call(ctx.model, hpm, (x,)).detach()

    def loss_fn(model, params, x, y):
        logits = functional_call(model, params, (x,))
        return 0.5 * F.cross_entropy(logits, y) + 0.5 * kd_loss(logits, teacher, 2.0)

    assert_params_close(new["model"], step(glob, grads(ctx.model, glob, x, y, loss_fn), 0.1))

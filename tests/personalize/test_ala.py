"""ALA maths and behaviour against the FedALA paper (docs/reference/methods/fedala.md): blending, the weight
gradient and update, the start phase, sampling, the feature cache and the closed-form head.
ALA as a method (FedALA, X+ala) and its reference transcription are in tests/methods/test_fedala.py."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms import TrainSettings
from pflkit.functional import forward
from pflkit.models import FedAvgCNN, build_model, count_parameters, reference_layer_idx, top_unit_names
from pflkit.personalize import AdaptiveLocalAggregation, ALASettings, blend, clip_weights, weight_update
from tests.support.builders import params_of, tiny_context


def make_ala(ctx, **kw) -> AdaptiveLocalAggregation:
    return AdaptiveLocalAggregation(ALASettings(**kw), ctx.units, ctx.train)


def test_blend_with_ones_is_overwrite_and_zeros_keep_local():
    ctx = tiny_context()
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    ones = {k: torch.ones_like(v) for k, v in local.items()}
    zeros = {k: torch.zeros_like(v) for k, v in local.items()}
    for k, v in blend(local, glob, ones).items():
        torch.testing.assert_close(v, glob[k], rtol=0, atol=1e-7)
    for k, v in blend(local, glob, zeros).items():
        assert torch.equal(v, local[k])


def test_weight_gradient_matches_autograd_through_w():
    ctx = tiny_context()
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    top = top_unit_names(ctx.units, 2)
    w = {k: torch.rand_like(local[k]).requires_grad_(True) for k in top}
    x, y = ctx.data.train_x[:10], ctx.data.train_y[:10]
    # autograd straight through W
    blended = {**glob, **blend(local, glob, w)}
    loss = F.cross_entropy(forward(ctx.model, blended, x), y)
    auto = torch.autograd.grad(loss, [w[k] for k in top])
    # chain rule of paper Eq. 7: dL/dTheta_hat * (global - local)
    leaves = {k: blended[k].detach().requires_grad_(True) for k in top}
    loss2 = F.cross_entropy(forward(ctx.model, {**glob, **leaves}, x), y)
    g_hat = torch.autograd.grad(loss2, [leaves[k] for k in top])
    for k, a, g in zip(top, auto, g_hat):
        torch.testing.assert_close(g * (glob[k] - local[k]), a, rtol=1e-5, atol=1e-7)


def test_weight_update_then_clip_to_unit_interval():
    w = torch.tensor([0.0, 0.5, 1.0, 0.9, 0.1])
    grad = torch.tensor([1.0, 1.0, -1.0, -10.0, 10.0])
    delta = torch.ones(5)
    out = {"w": weight_update(w, grad, delta, eta=0.2)}
    torch.testing.assert_close(out["w"], torch.tensor([-0.2, 0.3, 1.2, 2.9, -1.9]))
    clip_weights(out)
    torch.testing.assert_close(out["w"], torch.tensor([0.0, 0.3, 1.0, 1.0, 0.0]))


@pytest.mark.parametrize("p,expected", [(1, 5130), (2, 529930), (3, 581194), (4, 582026)])
def test_ala_weight_count_per_p_on_fedavg_cnn(p, expected):
    model = build_model("fedavg_cnn", (1, 28, 28), 10)
    ala = AdaptiveLocalAggregation(ALASettings(p=p), model.units(), TrainSettings())
    params = dict(model.named_parameters())
    assert count_parameters(model, ala.top_names(params)) == expected
    assert reference_layer_idx(model.units(), p) == 2 * p  # weight+bias per unit in the reference code


def test_fedavg_cnn_sizes_match_spec():
    assert count_parameters(FedAvgCNN(1, 10, 28)) == 582026
    assert count_parameters(FedAvgCNN(3, 10, 32)) == 878538
    assert count_parameters(FedAvgCNN(3, 100, 32)) == 924708


def test_p_out_of_range_is_rejected():
    ctx = tiny_context()
    with pytest.raises(ValueError, match="p=5 exceeds"):
        make_ala(ctx, p=5)


def test_inactive_when_global_equals_local():
    ctx = tiny_context()
    local = params_of(ctx, 1)
    ala = make_ala(ctx)
    state = ala.init_state(local)
    out, new_state, info = ala(dict(local), local, state, ctx)
    assert info["ala_epochs"] == 0 and not new_state["started"]
    assert all(torch.equal(new_state["weights"][k], state["weights"][k]) for k in state["weights"])
    assert all(torch.equal(out[k], local[k]) for k in local)


def test_lower_units_overwritten_top_units_blended_and_weights_persist():
    ctx = tiny_context(n_train=40)
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    ala = make_ala(ctx, p=1, max_start_epochs=3, eta=1.0)
    out, state, info = ala(glob, local, ala.init_state(local), ctx)
    top = set(top_unit_names(ctx.units, 1))
    for k in local:
        if k not in top:
            assert torch.equal(out[k], glob[k]), k
    w = state["weights"]
    assert set(w) == top and state["started"]
    for k in top:  # out = local + (global - local) * W exactly
        torch.testing.assert_close(out[k], local[k] + (glob[k] - local[k]) * w[k])
        assert w[k].min() >= 0 and w[k].max() <= 1
    assert any((w[k] < 1).any() for k in top), "weights never moved from their initial ones"
    assert info["ala_epochs"] == 3  # start phase ran to the cap
    # after the start phase: exactly one epoch, continuing from the stored weights
    out2, state2, info2 = ala(glob, local, state, ctx)
    assert info2["ala_epochs"] == 1
    assert any(not torch.equal(state2["weights"][k], w[k]) for k in top)


def test_start_phase_stops_on_convergence_before_cap():
    ctx = tiny_context(n_train=40)
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    ala = make_ala(ctx, threshold=10.0, num_pre_loss=3, max_start_epochs=50)
    _, _, info = ala(glob, local, ala.init_state(local), ctx)
    assert info["ala_epochs"] == 4  # more than num_pre_loss losses, std < huge threshold


def test_matches_transcription_of_reference_loop():
    """One non-start-phase ALA epoch equals a literal re-statement of Algorithm 1 lines 6-20."""
    ctx = tiny_context(n_train=25, batch_size=10)
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    ala = make_ala(ctx, p=2, eta=0.7, sample_fraction=1.0)
    state = {**ala.init_state(local), "started": True}
    out, state_out, _ = ala(glob, local, state, ctx)
    # transcription
    sample = ctx.sample("ala", 1.0)
    x, y = sample.x, sample.y
    top = top_unit_names(ctx.units, 2)
    w = {k: torch.ones_like(local[k]) for k in top}
    theta = {**local, **{k: v for k, v in glob.items() if k not in top}}
    for i in range(0, len(y), 10):
        for k in top:
            theta[k] = (local[k] + (glob[k] - local[k]) * w[k]).detach().requires_grad_(True)
        loss = F.cross_entropy(forward(ctx.model, theta, x[i : i + 10]), y[i : i + 10])
        loss.backward()
        for k in top:
            w[k] = torch.clamp(w[k] - 0.7 * theta[k].grad * (glob[k] - local[k]), 0, 1)
    for k in top:
        torch.testing.assert_close(state_out["weights"][k], w[k])
        torch.testing.assert_close(out[k], local[k] + (glob[k] - local[k]) * w[k])


@pytest.mark.parametrize("n_train", [1, 3, 9])
def test_robust_to_clients_smaller_than_a_batch(n_train):
    ctx = tiny_context(n_train=n_train, batch_size=10)
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    ala = make_ala(ctx, sample_fraction=0.5, max_start_epochs=4)
    out, state, info = ala(glob, local, ala.init_state(local), ctx)
    assert info["ala_epochs"] == 4 and all(torch.isfinite(v).all() for v in out.values())


def test_contiguous_sampling_takes_a_slice():
    ctx = tiny_context(n_train=50)
    x = ctx.sample("ala", 0.2, "contiguous").x
    rows = [int(torch.nonzero((ctx.data.train_x == r).all(dim=(1, 2, 3)))[0]) for r in x]
    assert len(rows) == 10 and rows == list(range(rows[0], rows[0] + 10))


def test_weight_statistics_of_a_hand_set_w() -> None:
    from pflkit.personalize.ala import weight_statistics

    units = [("fc1", ["fc1.weight"]), ("fc", ["fc.weight", "fc.bias"])]
    w = {"fc.weight": torch.tensor([[0.0, 1.0], [0.5, 0.5]]), "fc.bias": torch.tensor([1.0, 1.0])}
    stats = {k: float(v) for k, v in weight_statistics(w, units).items()}  # one client: 0-dim tensors
    values = torch.tensor([0.0, 1.0, 0.5, 0.5, 1.0, 1.0])
    assert set(stats) == {"ala_w_mean.fc", "ala_w_std.fc", "ala_w_zero.fc", "ala_w_one.fc"}  # fc1 not blended
    assert stats["ala_w_mean.fc"] == pytest.approx(4 / 6) and stats["ala_w_zero.fc"] == pytest.approx(1 / 6)
    assert stats["ala_w_one.fc"] == pytest.approx(3 / 6)
    assert stats["ala_w_std.fc"] == pytest.approx(float(values.std(unbiased=False)))
    batched = weight_statistics({k: torch.stack([v, torch.ones_like(v)]) for k, v in w.items()}, units, client_dims=1)
    assert batched["ala_w_mean.fc"].tolist() == pytest.approx([4 / 6, 1.0])
    assert batched["ala_w_one.fc"].tolist() == pytest.approx([0.5, 1.0])


# ---- the feature cache and the closed-form head (the fast paths) ------------------------------


@pytest.mark.parametrize("p", [1, 2, 3])
def test_ala_feature_cache_gives_the_same_weights(p):
    ctx = tiny_context(n_train=47)
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    results = []
    for cache in (True, False):
        ala = AdaptiveLocalAggregation(ALASettings(p=p, max_start_epochs=4, cache_features=cache), ctx.units, ctx.train)
        out, state, info = ala(glob, local, ala.init_state(glob), ctx)
        out2, state2, _ = ala(glob, local, state, ctx)
        results.append((out2, state2["weights"], info["ala_epochs"]))
    (o1, w1, e1), (o2, w2, e2) = results
    assert e1 == e2 == 4
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(o1[k], o2[k], rtol=1e-6, atol=1e-7)
    cached = AdaptiveLocalAggregation(ALASettings(p=p), ctx.units, ctx.train)
    assert cached.prefix_stop(ctx.model, 4 - p) == 4 - p  # the cache was really used
    assert ala.prefix_stop(ctx.model, 4 - p) == 0


def test_closed_form_linear_head_gradient_equals_autograd():
    from pflkit.personalize.ala import linear_head_step

    g = torch.Generator().manual_seed(0)
    h, y = torch.randn(7, 64, generator=g), torch.randint(0, 10, (7,), generator=g)
    w = torch.randn(10, 64, generator=g).requires_grad_(True)
    b = torch.randn(10, generator=g).requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b), y)
    gw, gb = torch.autograd.grad(loss, [w, b])
    target = torch.nn.functional.one_hot(y, 10).float() / len(y)
    loss2, gw2, gb2 = linear_head_step(h, target, w.detach(), b.detach())
    torch.testing.assert_close(loss2, loss.detach())
    torch.testing.assert_close(gw2, gw)
    torch.testing.assert_close(gb2, gb)


def test_closed_form_ala_matches_the_autograd_path():
    ctx = tiny_context(n_train=53)
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    outs = []
    for closed in (True, False):
        ala = AdaptiveLocalAggregation(
            ALASettings(p=1, max_start_epochs=5, closed_form_head=closed), ctx.units, ctx.train
        )
        assert ala.closed_form(ctx.model, 3, ala.top_names(glob)) is closed
        out, state, info = ala(glob, local, ala.init_state(glob), ctx)
        outs.append((out, state["weights"], info["ala_epochs"]))
    for k in outs[0][1]:
        torch.testing.assert_close(outs[0][1][k], outs[1][1][k], rtol=1e-5, atol=1e-6)
    assert outs[0][2] == outs[1][2]

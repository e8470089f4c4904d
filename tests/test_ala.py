"""ALA maths and behaviour against the spec (algorithms.md §1.2-1.7)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms import TrainSettings
from pflkit.functional import forward
from pflkit.methods import build_algorithm
from pflkit.models import FedAvgCNN, build_model, count_parameters, reference_layer_idx, top_unit_names
from pflkit.personalize import AdaptiveLocalAggregation, ALASettings, blend, clip_weights, weight_update

from helpers import params_of, tiny_context


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
        loss = F.cross_entropy(forward(ctx.model, theta, x[i:i + 10]), y[i:i + 10])
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


def test_with_ala_replaces_only_local_init_for_fedprox_and_ditto_targets():
    from pflkit.config import load_config

    ctx = tiny_context(n_train=30)
    cfg = load_config(None, ["fedala.max_start_epochs=2"])
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    for name, key in [("fedprox+ala", "model"), ("ditto+ala", "model")]:
        alg = build_algorithm(name, cfg.algorithm_sections(), ctx.train, ctx.units)
        state = alg.init_client(local, 0)
        state, _ = alg.local_init({"global": glob}, state, ctx)
        assert state["ala"]["started"]
        assert not all(torch.equal(state[key][k], glob[k]) for k in glob)
    cfg = load_config(None, ["fedala.max_start_epochs=2", "ditto.ala_target='personal'"])
    alg = build_algorithm("ditto+ala", cfg.algorithm_sections(), ctx.train, ctx.units)
    state = alg.init_client(local, 0)
    state["personal"] = params_of(ctx, 3)
    state, _ = alg.local_init({"global": glob}, state, ctx)
    assert all(torch.equal(state["model"][k], glob[k]) for k in glob)  # global track overwritten
    top = top_unit_names(ctx.units, 1)
    assert not all(torch.equal(state["personal"][k], glob[k]) for k in top)  # personal blended


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


def test_start_round_and_freeze_after_start(tmp_path) -> None:
    import json

    from pflkit.config import load_config
    from pflkit.run.experiment import run_experiment

    def rows(*overrides: str) -> list[dict]:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        config = load_config(None, ["num_clients=4", "rounds=4", 'algorithms=["fedala"]', "fedala.max_start_epochs=3",
                                    *overrides])
        run_experiment(config, out, progress=False, echo=lambda s: None)
        return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train_round" in r]

    late = rows("fedala.start_round=3")
    assert [r["ala_epochs"] for r in late][:2] == [0, 0] and late[2]["ala_epochs"] > 0  # off, off, start phase
    frozen = rows("fedala.freeze_after_start=true")
    assert frozen[1]["ala_epochs"] > 0 and frozen[2]["ala_epochs"] == 0 and frozen[3]["ala_epochs"] == 0
    assert frozen[2]["ala_w_mean.fc"] == frozen[3]["ala_w_mean.fc"] == frozen[1]["ala_w_mean.fc"]  # W reused
    learning = rows()
    assert learning[2]["ala_epochs"] > 0 and learning[2]["ala_w_mean.fc"] != learning[1]["ala_w_mean.fc"]


def test_plot_ala_draws_the_weights_and_refuses_runs_without_ala(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from pflkit.cli import main
    from pflkit.config import load_config
    from pflkit.run.experiment import run_experiment

    config = load_config(None, ["num_clients=4", "rounds=2", 'algorithms=["fedavg", "fedala"]'])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    result = CliRunner().invoke(main, ["plot", "ala", str(tmp_path / "run"), "--client", "1"])
    assert result.exit_code == 0 and (tmp_path / "run" / "plots" / "ala.png").is_file()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    start = [r for r in records if r["algorithm"] == "fedala" and "ala_start_losses" in r]
    assert [r["round"] for r in start] == [2]  # the start phase: the first round with a received model
    curve = start[0]["ala_start_losses"]["1"]
    assert len(curve) > 1 and curve[-1] < curve[0]  # weight learning lowers the loss
    config = load_config(None, ["num_clients=4", "rounds=1", 'algorithms=["fedavg"]'])
    run_experiment(config, tmp_path / "plain", progress=False, echo=lambda s: None)
    result = CliRunner().invoke(main, ["plot", "ala", str(tmp_path / "plain")])
    assert result.exit_code == 2 and "has no ALA method" in result.output

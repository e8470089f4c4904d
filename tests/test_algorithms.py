"""Update rules of the baselines on a tiny problem (spec §2.1, 2.2, 2.5, 2.7)."""

from __future__ import annotations

import torch

from pflkit.algorithms import TrainBatches
from pflkit.config import load_config
from pflkit.functional import classification_loss, proximal_loss, weighted_average
from pflkit.methods import build_algorithm
from pflkit.models import head_names

from helpers import params_of, tiny_context


def build(name: str, ctx, *overrides: str):
    cfg = load_config(None, list(overrides))
    return build_algorithm(name, cfg.algorithm_sections(), ctx.train, ctx.units)


def test_weighted_average_is_sample_weighted():
    a = {"w": torch.tensor([0.0, 2.0])}
    b = {"w": torch.tensor([4.0, 6.0])}
    out = weighted_average([a, b], [1, 3])
    torch.testing.assert_close(out["w"], torch.tensor([3.0, 5.0]))


def test_fit_step_is_plain_gradient_descent_with_proximal_term():
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.5)
    p0, anchor = params_of(ctx, 1), params_of(ctx, 2)
    batch = [(ctx.data.train_x, ctx.data.train_y)]
    new = ctx.fit(p0, proximal_loss(classification_loss, 0.3), aux={"anchor": anchor}).params
    leaves = {k: v.clone().requires_grad_(True) for k, v in p0.items()}
    loss = torch.nn.functional.cross_entropy(torch.func.functional_call(ctx.model, leaves, (batch[0][0],)),
                                             batch[0][1])
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    for k in p0:
        expected = p0[k] - 0.5 * (grads[k] + 0.3 * (p0[k] - anchor[k]))
        torch.testing.assert_close(new[k], expected, rtol=1e-5, atol=1e-6)


def test_fedavg_round_overwrites_and_uploads_trained_model():
    ctx = tiny_context()
    alg = build("fedavg", ctx)
    glob = params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(params_of(ctx, 1), 0), ctx)
    assert all(torch.equal(state["model"][k], glob[k]) for k in glob)
    state, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    assert upload["num_samples"] == 30 and metrics["train_loss"] > 0
    assert upload["params"] is state["model"] or all(torch.equal(upload["params"][k], state["model"][k])
                                                     for k in glob)
    assert not all(torch.equal(state["model"][k], glob[k]) for k in glob)


def test_fedprox_with_zero_mu_equals_fedavg_and_large_mu_stays_near_global():
    ctx = tiny_context()
    glob = params_of(ctx, 2)
    results = {}
    for name, mu in [("fedavg", None), ("fedprox", "0.0"), ("fedprox", "5.0")]:
        alg = build(name, ctx, *( [f"fedprox.mu={mu}"] if mu else []))
        state, _ = alg.local_init({"global": glob}, alg.init_client(glob, 0), ctx)
        results[(name, mu)] = alg.local_train({"global": glob}, state, ctx)[1]["params"]
    for k in glob:
        torch.testing.assert_close(results[("fedprox", "0.0")][k], results[("fedavg", None)][k])
    dist = lambda p: sum(((p[k] - glob[k]) ** 2).sum() for k in glob)  # noqa: E731
    assert dist(results[("fedprox", "5.0")]) < dist(results[("fedavg", None)])


def test_fedrep_uploads_body_only_and_keeps_its_head():
    ctx = tiny_context()
    alg = build("fedrep", ctx, "fedrep.head_epochs=2")
    head = head_names(ctx.units)
    server = alg.init_server(params_of(ctx, 2))
    payload = alg.downlink(server, 0, 1)
    assert not set(head) & set(payload["global"])
    local = params_of(ctx, 1)
    state, _ = alg.local_init(payload, alg.init_client(local, 0), ctx)
    for k in head:
        assert torch.equal(state["model"][k], local[k])  # head never overwritten
    new_state, upload, _ = alg.local_train(payload, state, ctx)
    assert set(upload["params"]) == set(payload["global"])
    assert any(not torch.equal(new_state["model"][k], local[k]) for k in head)  # head trained
    merged = alg.aggregate(server, [{**upload, "client_id": 0}, {**upload, "client_id": 1}], 1)["global"]
    for k in head:
        assert torch.equal(merged[k], server["global"][k])  # server head untouched


def test_fedrep_clip_norm_bounds_every_step_of_both_phases():
    ctx = tiny_context(n_train=30)  # 3 batches of 10 per epoch, lr 0.1
    payload = {"global": params_of(ctx, 2)}
    head = head_names(ctx.units)
    for clip, bounded in ((1e-4, True), (0.0, False)):
        alg = build("fedrep", ctx, "fedrep.head_epochs=2", f"fedrep.clip_norm={clip}")
        state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 1), 0), ctx)
        new, _, _ = alg.local_train(payload, state, ctx)
        moved = {name: torch.cat([(new["model"][k] - state["model"][k]).flatten() for k in names]).norm()
                 for name, names in (("head", head), ("body", [k for k in state["model"] if k not in head]))}
        # each step moves the trained part by at most lr * clip: 6 head steps, then 3 body steps
        assert (float(moved["head"]) <= 6 * 0.1 * 1e-4 * 1.001 and float(moved["body"]) <= 3 * 0.1 * 1e-4 * 1.001) \
            == bounded, moved


def test_ditto_personal_model_is_evaluated_and_anchored_to_global():
    ctx = tiny_context()
    glob = params_of(ctx, 2)
    alg = build("ditto", ctx, "ditto.mu=0.0", "ditto.personal_epochs=1")
    state, _ = alg.local_init({"global": glob}, alg.init_client(params_of(ctx, 1), 0), ctx)
    assert alg.eval_params(state) is state["personal"]
    new, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    # with mu = 0 the personal step is plain SGD on the personal stream
    expected = ctx.fit(state["personal"], classification_loss, data=TrainBatches("personal", 1)).params
    for k in glob:
        torch.testing.assert_close(new["personal"][k], expected[k])
    strong = build("ditto", ctx, "ditto.mu=5.0", "ditto.personal_epochs=1")
    pulled = strong.local_train({"global": glob}, state, ctx)[0]["personal"]
    gap = lambda p: sum(((p[k] - glob[k]) ** 2).sum() for k in glob)  # noqa: E731
    assert gap(pulled) < gap(new["personal"])


def test_batches_drop_last_but_small_clients_train_on_one_batch():
    ctx = tiny_context(n_train=25, batch_size=10)
    sizes = [len(b.y) for b in ctx.batches(TrainBatches("train", 2))]
    assert sizes == [10, 10, 10, 10]
    small = tiny_context(n_train=4, batch_size=10)
    assert [len(b.y) for b in small.batches(TrainBatches("train", 1))] == [4]
    again = [b.y.tolist() for b in ctx.batches(TrainBatches("train", 1))]
    assert again == [b.y.tolist() for b in ctx.batches(TrainBatches("train", 1))]  # same stream, same order

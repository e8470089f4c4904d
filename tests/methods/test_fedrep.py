"""FedRep: body-only uploads, the kept head and the clip by themselves, and against my
transcription of PFLlib f1e313a (``clients/clientrep.py``, ``servers/serverrep.py``)."""

from __future__ import annotations

import torch

from pflkit.models import head_names
from tests.support.builders import batch_pairs, build, params_of, tiny_context
from tests.support.checks import assert_params_close, moved
from tests.support.references import network, pfllib_server_average, pfllib_sgd_epochs, weights


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
        moved = {
            name: torch.cat([(new["model"][k] - state["model"][k]).flatten() for k in names]).norm()
            for name, names in (("head", head), ("body", [k for k in state["model"] if k not in head]))
        }
        # each step moves the trained part by at most lr * clip: 6 head steps, then 3 body steps
        assert (
            float(moved["head"]) <= 6 * 0.1 * 1e-4 * 1.001 and float(moved["body"]) <= 3 * 0.1 * 1e-4 * 1.001
        ) == bounded, moved


def pfllib_fedrep_client(ctx, body: dict, head: dict, lr: float, head_epochs: int) -> dict:
    """clientrep.py ``train``: freeze the base, plocal_steps epochs of SGD (poptimizer, same lr) on
    the predictor (the last layer, main.py: ``args.model.fc``); then freeze the predictor and run E
    epochs of SGD (optimizer over the base). ``set_parameters`` only replaces the base."""
    net = network(ctx, {**body, **head})
    head_params = [p for k, p in net.named_parameters() if k in head]
    body_params = [p for k, p in net.named_parameters() if k in body]
    for p in body_params:
        p.requires_grad_(False)
    pfllib_sgd_epochs(net, batch_pairs(ctx, "head", head_epochs), lr, head_params)
    for p in body_params:
        p.requires_grad_(True)
    for p in head_params:
        p.requires_grad_(False)
    pfllib_sgd_epochs(net, batch_pairs(ctx, "train", ctx.train.local_epochs), lr, body_params)
    return weights(net)


def test_fedrep_is_pfllib_head_epochs_then_body_epochs_and_a_body_only_server():
    ctxs = [tiny_context(n_train=30, seed=0, epochs=2), tiny_context(n_train=20, seed=1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    head_epochs = 2
    alg = build("fedrep", ctxs[0], f"fedrep.head_epochs={head_epochs}", "fedrep.clip_norm=0")  # PFLlib: no clip
    assert alg.settings.clip_norm == 0  # pflkit's optional clipping is off: PFLlib has none
    head_names = [k for k in glob if k.startswith("fc.")]
    body_names = [k for k in glob if k not in head_names]
    server = alg.init_server(glob)
    payload = alg.downlink(server, 0, 1)
    assert sorted(payload["global"]) == sorted(body_names)  # clientrep.set_parameters: base only
    expected, uploads, heads = [], [], []
    for i, ctx in enumerate(ctxs):
        local = params_of(ctx, 7 + i)  # a client's own head from earlier rounds
        state, _ = alg.local_init(payload, alg.init_client(local, i), ctx)
        body = {k: glob[k] for k in body_names}
        head = {k: local[k] for k in head_names}
        assert_params_close(alg.eval_params(state), {**body, **head})  # scored: (global body, local head)
        new, upload, _ = alg.local_train(payload, state, ctx)
        ref = pfllib_fedrep_client(ctx, body, head, lr=0.1, head_epochs=head_epochs)
        assert_params_close(new["model"], ref)
        assert_params_close(upload["params"], {k: ref[k] for k in body_names})  # serverrep.receive_models: model.base
        expected.append({k: ref[k] for k in body_names})
        heads.append({k: ref[k] for k in head_names})
        uploads.append({**upload, "client_id": i})
    assert moved(heads[0], {k: params_of(ctxs[0], 7)[k] for k in head_names})
    out = alg.aggregate(server, uploads, 1)
    assert_params_close({k: out["global"][k] for k in body_names}, pfllib_server_average(expected, [30, 20]))
    # next round: the new body arrives, each client keeps its trained head
    state, _ = alg.local_init(alg.downlink(out, 0, 2), {"model": {**expected[0], **heads[0]}}, ctxs[0])
    assert_params_close(alg.eval_params(state), {**{k: out["global"][k] for k in body_names}, **heads[0]})

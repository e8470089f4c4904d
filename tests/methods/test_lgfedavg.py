"""LG-FedAvg: head-only uploads and the kept body by themselves, and against my transcription of
PFLlib ad7bcd6, the commit that adds it (``clients/clientlg.py``, ``servers/serverlg.py``, with
``clientbase.py`` and ``serverbase.py``)."""

from __future__ import annotations

import torch

from pflkit.models import head_names
from tests.support.builders import batch_pairs, build, params_of, tiny_context
from tests.support.checks import assert_params_close, moved
from tests.support.references import network, pfllib_server_average, pfllib_sgd_epochs, weights


def test_lgfedavg_shares_the_head_trains_body_and_head_and_keeps_its_body():
    ctx = tiny_context()
    alg = build("lgfedavg", ctx)
    head = head_names(ctx.units)
    server = alg.init_server(params_of(ctx, 2))
    payload = alg.downlink(server, 0, 1)
    assert sorted(payload["global"]) == sorted(head)
    local = params_of(ctx, 1)
    state, _ = alg.local_init(payload, alg.init_client(local, 0), ctx)
    body = [k for k in local if k not in head]
    assert all(torch.equal(state["model"][k], local[k]) for k in body)  # body never overwritten
    assert all(torch.equal(state["model"][k], server["global"][k]) for k in head)
    new, upload, _ = alg.local_train(payload, state, ctx)
    assert sorted(upload["params"]) == sorted(head)
    assert moved({k: new["model"][k] for k in body}, {k: local[k] for k in body})  # body trained
    merged = alg.aggregate(server, [{**upload, "client_id": 0}], 1)["global"]
    assert all(torch.equal(merged[k], server["global"][k]) for k in body)  # server body untouched
    assert all(torch.equal(merged[k], upload["params"][k]) for k in head)
    assert alg.head_update(server, {**upload, "client_id": 0}) is not None  # the head is uploaded


def pfllib_lg_client(ctx, body: dict, head: dict, lr: float) -> dict:
    """clientlg.py: ``set_parameters(head)`` copies the received head into ``model.head`` only;
    ``train`` runs E epochs of clientbase's torch.optim.SGD(lr) over all of the model: per batch
    forward, CrossEntropyLoss, zero_grad, backward, step (no DP, no learning-rate decay: the defaults)."""
    net = network(ctx, {**body, **head})
    pfllib_sgd_epochs(net, batch_pairs(ctx, "train", ctx.train.local_epochs), lr)
    return weights(net)


def test_lgfedavg_is_pfllib_clientlg_joint_epochs_and_a_head_only_server():
    ctxs = [tiny_context(n_train=30, seed=0, epochs=2), tiny_context(n_train=20, seed=1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    alg = build("lgfedavg", ctxs[0])
    head_names_ = [k for k in glob if k.startswith("fc.")]
    body_names = [k for k in glob if k not in head_names_]
    server = alg.init_server(glob)
    payload = alg.downlink(server, 0, 1)
    assert sorted(payload["global"]) == sorted(head_names_)  # serverlg: global_model = args.model.head
    expected, uploads, bodies = [], [], []
    for i, ctx in enumerate(ctxs):
        local = params_of(ctx, 7 + i)  # a client's own body from earlier rounds
        state, _ = alg.local_init(payload, alg.init_client(local, i), ctx)
        body = {k: local[k] for k in body_names}
        head = {k: glob[k] for k in head_names_}
        assert_params_close(alg.eval_params(state), {**body, **head})  # scored: (local body, global head)
        new, upload, _ = alg.local_train(payload, state, ctx)
        ref = pfllib_lg_client(ctx, body, head, lr=0.1)
        assert_params_close(new["model"], ref)
        assert_params_close(upload["params"], {k: ref[k] for k in head_names_})  # serverlg: client.model.head
        expected.append({k: ref[k] for k in head_names_})
        bodies.append({k: ref[k] for k in body_names})
        uploads.append({**upload, "client_id": i})
    assert [u["num_samples"] for u in uploads] == [30, 20]  # serverlg.receive_models: train_samples
    assert moved(bodies[0], {k: params_of(ctxs[0], 7)[k] for k in body_names})  # the body trains too
    assert moved(expected[0], {k: glob[k] for k in head_names_})
    out = alg.aggregate(server, uploads, 1)
    assert_params_close({k: out["global"][k] for k in head_names_}, pfllib_server_average(expected, [30, 20]))
    # next round: the averaged head arrives, each client keeps the body it trained
    state, _ = alg.local_init(alg.downlink(out, 0, 2), {"model": {**bodies[0], **expected[0]}}, ctxs[0])
    assert_params_close(alg.eval_params(state), {**bodies[0], **{k: out["global"][k] for k in head_names_}})


def test_lgfedavg_shares_its_top_global_units():
    """global_units = 2 on the digits CNN (conv1, conv2, fc1, fc): fc1 and fc travel, the convolutions
    stay on the client."""
    ctx = tiny_context()
    alg = build("lgfedavg", ctx, "lgfedavg.global_units=2")
    shared = [k for _, unit in ctx.units[-2:] for k in unit]
    server = alg.init_server(params_of(ctx, 2))
    payload = alg.downlink(server, 0, 1)
    assert sorted(payload["global"]) == sorted(shared)
    local = params_of(ctx, 1)
    state, _ = alg.local_init(payload, alg.init_client(local, 0), ctx)
    assert all(torch.equal(state["model"][k], local[k]) for k in local if k not in shared)
    _, upload, _ = alg.local_train(payload, state, ctx)
    assert sorted(upload["params"]) == sorted(shared)

"""FedPer: body-only uploads and the kept head by themselves, and against my transcription of PFLlib
f1e313a (``clients/clientper.py``, ``servers/serverper.py``, with ``clientbase.py`` and
``serverbase.py``)."""

from __future__ import annotations

import torch

from pflkit.models import head_names
from tests.support.builders import batch_pairs, build, params_of, tiny_context
from tests.support.checks import assert_params_close, moved
from tests.support.references import network, pfllib_server_average, pfllib_sgd_epochs, weights


def test_fedper_shares_the_body_trains_body_and_head_and_keeps_its_head():
    ctx = tiny_context()
    alg = build("fedper", ctx)
    head = head_names(ctx.units)
    server = alg.init_server(params_of(ctx, 2))
    payload = alg.downlink(server, 0, 1)
    assert sorted(payload["global"]) == sorted(k for k in server["global"] if k not in head)
    local = params_of(ctx, 1)
    state, _ = alg.local_init(payload, alg.init_client(local, 0), ctx)
    assert all(torch.equal(state["model"][k], local[k]) for k in head)  # head never overwritten
    new, upload, _ = alg.local_train(payload, state, ctx)
    assert set(upload["params"]) == set(payload["global"])
    assert moved({k: new["model"][k] for k in head}, {k: local[k] for k in head})  # head trained
    assert moved(upload["params"], payload["global"])  # body trained too
    merged = alg.aggregate(server, [{**upload, "client_id": 0}], 1)["global"]
    assert all(torch.equal(merged[k], server["global"][k]) for k in head)  # server head untouched
    assert alg.head_update(server, {**upload, "client_id": 0}) is None  # no head is uploaded


def pfllib_fedper_client(ctx, body: dict, head: dict, lr: float) -> dict:
    """clientper.py: ``set_parameters`` copies the received model's parameters into ``model.base``
    (zip stops at the base); ``train`` runs E epochs of torch.optim.SGD(lr) over all of the model
    (``self.model.parameters()``): zero_grad, CrossEntropyLoss, backward, step, per batch."""
    net = network(ctx, {**body, **head})
    pfllib_sgd_epochs(net, batch_pairs(ctx, "train", ctx.train.local_epochs), lr)
    return weights(net)


def test_fedper_is_pfllib_clientper_joint_epochs_and_a_body_only_server():
    ctxs = [tiny_context(n_train=30, seed=0, epochs=2), tiny_context(n_train=20, seed=1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    alg = build("fedper", ctxs[0])
    head_names_ = [k for k in glob if k.startswith("fc.")]
    body_names = [k for k in glob if k not in head_names_]
    server = alg.init_server(glob)
    payload = alg.downlink(server, 0, 1)
    assert sorted(payload["global"]) == sorted(body_names)  # clientper.set_parameters: the base only
    expected, uploads, heads = [], [], []
    for i, ctx in enumerate(ctxs):
        local = params_of(ctx, 7 + i)  # a client's own head from earlier rounds
        state, _ = alg.local_init(payload, alg.init_client(local, i), ctx)
        body = {k: glob[k] for k in body_names}
        head = {k: local[k] for k in head_names_}
        assert_params_close(alg.eval_params(state), {**body, **head})  # scored: (global body, local head)
        new, upload, _ = alg.local_train(payload, state, ctx)
        ref = pfllib_fedper_client(ctx, body, head, lr=0.1)
        assert_params_close(new["model"], ref)
        assert_params_close(upload["params"], {k: ref[k] for k in body_names})  # serverper: client.model.base
        expected.append({k: ref[k] for k in body_names})
        heads.append({k: ref[k] for k in head_names_})
        uploads.append({**upload, "client_id": i})
    assert [u["num_samples"] for u in uploads] == [30, 20]  # serverper.receive_models: train_samples
    assert moved(heads[0], {k: params_of(ctxs[0], 7)[k] for k in head_names_})  # the head trains too
    assert moved(expected[0], {k: glob[k] for k in body_names})
    out = alg.aggregate(server, uploads, 1)
    assert_params_close({k: out["global"][k] for k in body_names}, pfllib_server_average(expected, [30, 20]))
    # next round: the averaged body arrives, each client keeps the head it trained
    state, _ = alg.local_init(alg.downlink(out, 0, 2), {"model": {**expected[0], **heads[0]}}, ctxs[0])
    assert_params_close(alg.eval_params(state), {**{k: out["global"][k] for k in body_names}, **heads[0]})


def test_fedper_keeps_its_top_personal_units_on_the_client():
    """personal_units = 2 on the digits CNN (conv1, conv2, fc1, fc): fc1 and fc stay, the convolutions
    travel; a head as deep as the model is refused."""
    import pytest

    ctx = tiny_context()
    alg = build("fedper", ctx, "fedper.personal_units=2")
    personal = [k for _, unit in ctx.units[-2:] for k in unit]
    server = alg.init_server(params_of(ctx, 2))
    payload = alg.downlink(server, 0, 1)
    assert sorted(payload["global"]) == sorted(k for k in server["global"] if k not in personal)
    local = params_of(ctx, 1)
    state, _ = alg.local_init(payload, alg.init_client(local, 0), ctx)
    assert all(torch.equal(state["model"][k], local[k]) for k in personal)
    _, upload, _ = alg.local_train(payload, state, ctx)
    assert set(upload["params"]) == set(payload["global"])
    assert build("fedper+ala", ctx, "fedper.personal_units=2").personal_names == set(personal)
    with pytest.raises(ValueError, match="a head of 4 units leaves no body in a model of 4 units"):
        build("fedper", ctx, "fedper.personal_units=4")

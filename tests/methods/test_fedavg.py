"""FedAvg: its round by itself, and against my transcription of PFLlib (TsingZ0/PFLlib f1e313a,
``clients/clientavg.py``, ``clients/clientbase.py``, ``servers/serveravg.py``, ``servers/serverbase.py``;
the shared loops are in tests/support/references.py)."""

from __future__ import annotations

import torch

from tests.support.builders import build, params_of, tiny_context, two_client_round
from tests.support.checks import assert_params_close, moved
from tests.support.references import pfllib_fedavg_client, pfllib_server_average


def test_fedavg_round_overwrites_and_uploads_trained_model():
    ctx = tiny_context()
    alg = build("fedavg", ctx)
    glob = params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(params_of(ctx, 1), 0), ctx)
    assert all(torch.equal(state["model"][k], glob[k]) for k in glob)
    state, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    assert upload["num_samples"] == 30 and metrics["train_loss"] > 0
    assert upload["params"] is state["model"] or all(torch.equal(upload["params"][k], state["model"][k]) for k in glob)
    assert not all(torch.equal(state["model"][k], glob[k]) for k in glob)


def test_fedavg_is_pfllib_clientavg_sgd_and_serverbase_sample_weighted_average():
    ctxs = [tiny_context(n_train=30, seed=0, epochs=2), tiny_context(n_train=20, seed=1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    alg, server, states, uploads = two_client_round("fedavg", ctxs, glob)
    expected = [pfllib_fedavg_client(ctx, glob, lr=0.1) for ctx in ctxs]
    for state, upload, ref in zip(states, uploads, expected):
        assert_params_close(state["model"], ref)
        assert_params_close(upload["params"], ref)
    assert [u["num_samples"] for u in uploads] == [30, 20]  # PFLlib: train_samples = len(train_data)
    assert moved(expected[0], glob) and moved(expected[0], expected[1])
    assert_params_close(server["global"], pfllib_server_average(expected, [30, 20]))
    # PFLlib evaluates every client on the just-sent global model (serveravg.py: send_models, evaluate)
    state, _ = alg.local_init(alg.downlink(server, 0, 2), alg.init_client(params_of(ctxs[0], 9), 0), ctxs[0])
    assert_params_close(alg.eval_params(state), server["global"])

"""Partner of the strict xfail ``test_fedamp_two_rounds_match_pfllib_f1e313a`` in
``tests/test_reference_pfllib_b.py``: the same two-round transcription of PFLlib's FedAMP with the
difference docs/algorithms.md records applied (the cloud model's self term xi_ii times the
client's own model, as PFLlib from 0998c54, instead of its previous cloud model) is pflkit's, so
that a third behaviour fails."""

from __future__ import annotations

from test_reference_pfllib_b import (
    AMP,
    PfllibAmpClient,
    as_module,
    assert_params_close,
    build,
    client_ctx,
    params_in,
    params_of,
    pfllib_amp_send,
    stream,
    summaries,
)


def test_fedamp_two_rounds_match_pfllib_with_the_own_model_as_the_self_term():
    model = client_ctx(0).model
    ctxs = {t: [client_ctx(i, n_train=20, lr=0.1, round=t, model=model) for i in range(3)] for t in (1, 2)}
    w0 = params_of(ctxs[1][0], 1)
    alg = build("fedamp", ctxs[1][0], *AMP)
    server = alg.prepare(alg.init_server(w0), summaries([20, 20, 20]))
    states = {i: alg.init_client(w0, i) for i in range(3)}
    clients = [PfllibAmpClient(as_module(model, w0), lr=0.1, lam=2.0, alpha_k=0.25) for _ in range(3)]
    for t in (1, 2):
        uploads = []
        for i in range(3):
            payload = alg.downlink(server, i, t)
            state, _ = alg.local_init(payload, states[i], ctxs[t][i])
            states[i], upload, _ = alg.local_train(payload, state, ctxs[t][i])
            uploads.append({**upload, "client_id": i})
        server = alg.aggregate(server, uploads, t)
        if t > 1:  # round 1: every cloud model is the initial model (PFLlib sends nothing, pflkit's equals it)
            coefs = pfllib_amp_send(clients, [c.model for c in clients], alpha_k=0.25, sigma=0.5,
                                    self_term="own_model")
            assert all(1 - sum(c) > 0.01 for c in coefs)  # xi_ii (about 0.02-0.04 here) is not negligible
        for i, c in enumerate(clients):
            c.train(stream(ctxs[t][i], "train"))
    for i in range(3):
        assert_params_close(states[i]["model"], params_in(clients[i].model))

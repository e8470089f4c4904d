"""Ditto: the personal model by itself, and against my transcription of PFLlib f1e313a
(``clients/clientditto.py``: ``ptrain``, ``train``, ``test_metrics``; ``servers/serverditto.py``)."""

from __future__ import annotations

import torch

from pflkit.algorithms import TrainBatches
from pflkit.functional import classification_loss
from tests.support.builders import batch_pairs, build, params_of, tiny_context
from tests.support.checks import assert_params_close, moved
from tests.support.references import network, pfllib_perturbed_epochs, pfllib_server_average, pfllib_sgd_epochs, weights


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


def pfllib_ditto_client(ctx, glob: dict, personal: dict, lr: float, mu: float, plocal: int) -> tuple[dict, dict]:
    """serverditto.py calls ``ptrain`` then ``train`` on every selected client after ``send_models``.
    clientditto.py ``ptrain``: plocal_steps epochs of PerturbedGradientDescent (same lr) on the
    persistent pmodel, anchored at ``self.model``'s parameters, i.e. the just-received global;
    ``train``: E epochs of plain SGD on ``self.model`` from the received global, which is uploaded."""
    model = network(ctx, glob)
    pmodel = network(ctx, personal)
    pfllib_perturbed_epochs(pmodel, weights(model), batch_pairs(ctx, "personal", plocal), lr, mu)
    pfllib_sgd_epochs(model, batch_pairs(ctx, "train", ctx.train.local_epochs), lr)
    return weights(model), weights(pmodel)


def test_ditto_is_pfllib_ptrain_then_train_with_the_personal_model_anchored_at_the_received_global():
    ctx = tiny_context(n_train=30, seed=0, epochs=2)
    glob, old_personal, old_model = params_of(ctx, 2), params_of(ctx, 3), params_of(ctx, 4)
    mu, plocal = 0.5, 2
    alg = build("ditto", ctx, f"ditto.mu={mu}", f"ditto.personal_epochs={plocal}")
    state = {**alg.init_client(old_model, 0), "personal": old_personal}
    state, _ = alg.local_init({"global": glob}, state, ctx)
    assert_params_close(alg.eval_params(state), old_personal)  # PFLlib's test_metrics score the pmodel
    new, upload, _ = alg.local_train({"global": glob}, state, ctx)
    ref_model, ref_personal = pfllib_ditto_client(ctx, glob, old_personal, lr=0.1, mu=mu, plocal=plocal)
    assert_params_close(new["personal"], ref_personal)
    assert_params_close(new["model"], ref_model)
    assert_params_close(upload["params"], ref_model)
    assert_params_close(alg.eval_params(new), ref_personal)
    # the anchor is the received global, not the old local model; and the term matters
    wrong_anchor = network(ctx, old_personal)
    pfllib_perturbed_epochs(wrong_anchor, old_model, batch_pairs(ctx, "personal", plocal), 0.1, mu)
    assert moved(ref_personal, weights(wrong_anchor))
    # server: FedAvg's aggregate_parameters over the uploaded global-track models
    ctx2 = tiny_context(n_train=20, seed=1, epochs=2)
    state2, _ = alg.local_init({"global": glob}, alg.init_client(params_of(ctx2, 5), 1), ctx2)
    _, upload2, _ = alg.local_train({"global": glob}, state2, ctx2)
    ref2, _ = pfllib_ditto_client(ctx2, glob, params_of(ctx2, 5), lr=0.1, mu=mu, plocal=plocal)
    out = alg.aggregate(alg.init_server(glob), [{**upload, "client_id": 0}, {**upload2, "client_id": 1}], 1)
    assert_params_close(out["global"], pfllib_server_average([ref_model, ref2], [30, 20]))

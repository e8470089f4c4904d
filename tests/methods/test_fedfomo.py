"""Partners of the three FedFomo strict xfails in ``tests/test_reference_pfllib_b.py``: the same
transcription of PFLlib f1e313a's clientFomo / serverFomo with the difference docs/algorithms.md
records applied asserts equality with pflkit, so that a third behaviour fails.

Recorded differences: pflkit weighs the *other* clients' models against its own trained model
(PFLlib: against its previous combined model, its own model among the candidates); pflkit scores
the combined model (PFLlib: last round's trained model); pflkit's affinity adds the weights
clipped at 0 (PFLlib: the raw ones)."""

from __future__ import annotations

import torch

from test_reference_pfllib_b import (
    PfllibFomoClient,
    as_module,
    assert_params_close,
    build,
    client_ctx,
    fomo_val_batches,
    params_in,
    params_of,
    perturbed,
    summaries,
)


def round_two():
    """Client 0 in round 2: every client's model after round 1, the server holding them."""
    model = client_ctx(0).model
    ctx = client_ctx(0, n_train=40, lr=0.1, round=2, model=model)
    w0 = params_of(ctx, 1)
    trained = [perturbed(w0, 20 + i, 0.05) for i in range(3)]
    alg = build("fedfomo", ctx)
    server = {**alg.prepare(alg.init_server(w0), summaries([40, 40, 40])), "models": dict(enumerate(trained))}
    state, _ = alg.local_init(alg.downlink(server, 0, 2), {"model": trained[0]}, ctx)
    # the transcription with pflkit's base and candidates: the own trained model is the base
    # (``old``), the other clients' models are the candidates
    ref = PfllibFomoClient(as_module(model, trained[0]), lr=0.1)
    ref.old = as_module(model, trained[0])
    ref.received = [as_module(model, m) for m in trained[1:]]
    ref.combine(fomo_val_batches(ctx))
    return alg, state, ref, trained


def test_fedfomo_round_two_combines_the_others_models_against_its_own_trained_model():
    """Partner of ``test_fedfomo_two_rounds_combine_as_pfllib``."""
    _, state, ref, trained = round_two()
    assert max(ref.raw_weights) > 0  # some candidate helps: the combination moves
    assert_params_close(state["model"], params_in(ref.model))
    assert max(float((state["model"][k] - trained[0][k]).abs().max()) for k in trained[0]) > 1e-3
    torch.testing.assert_close(state["weights"], torch.tensor([max(w, 0.0) for w in ref.raw_weights],
                                                              dtype=torch.float64), rtol=1e-5, atol=1e-8)


def test_fedfomo_evaluated_model_is_the_combined_model():
    """Partner of ``test_fedfomo_evaluated_model_is_pfllibs``: pflkit scores the transcription's
    combined model (before training), not the model the client trained last round."""
    alg, state, ref, _ = round_two()
    assert_params_close(alg.eval_params(state), params_in(ref.model))


def test_fedfomo_affinity_accumulates_the_clipped_weights():
    """Partner of ``test_fedfomo_affinity_accumulates_raw_weights_as_pfllib``: P starts as the
    identity and P[i, ids] gains max(w, 0), one weight below 0 clipped."""
    ctx = client_ctx(0, n_train=40, batch_size=10, lr=0.1)
    alg = build("fedfomo", ctx)
    old = {k: 6 * v for k, v in params_of(ctx, 1).items()}
    received = [params_of(ctx, 2), {k: 8 * v for k, v in params_of(ctx, 1).items()}, params_of(ctx, 3)]
    payload = {"models": received, "ids": torch.tensor([1, 2, 3])}
    state, _ = alg.local_init(payload, {"model": old}, ctx)
    _, upload, _ = alg.local_train(payload, state, ctx)
    server = alg.aggregate(alg.prepare(alg.init_server(old), summaries([40] * 4)), [{**upload, "client_id": 0}], 1)
    ref = PfllibFomoClient(as_module(ctx.model, old), lr=0.1)
    ref.received = [as_module(ctx.model, m) for m in received]
    ref.combine(fomo_val_batches(ctx))
    assert min(ref.raw_weights) < 0 < max(ref.raw_weights)
    expected = torch.tensor([1.0] + [max(w, 0.0) for w in ref.raw_weights], dtype=torch.float64)
    torch.testing.assert_close(server["affinity"][0], expected, rtol=1e-5, atol=1e-8)

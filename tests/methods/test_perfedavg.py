"""Partner of the strict xfail ``test_perfedavg_evaluated_model_is_pfllib_train_one_step`` in
``tests/test_reference_pfllib_b.py``: the same transcription (PFLlib f1e313a's two-rate SGD step)
with the difference docs/algorithms.md records applied (one step at alpha from the received model
on one batch of the client's training data, no beta step, no test data) is pflkit's evaluated
model, so that a third behaviour fails."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from helpers import batch_pairs, params_of
from test_reference_pfllib_b import TwoRateSGD, as_module, assert_params_close, build, client_ctx, params_in


def test_perfedavg_evaluated_model_is_one_alpha_step_on_a_training_batch():
    ctx = client_ctx(0, n_train=20, batch_size=4, lr=0.1)
    alg = build("perfedavg", ctx, "perfedavg.clip_norm=0")
    glob = params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(params_of(ctx, 1), 0), ctx)
    x, y = batch_pairs(ctx, "adapt")[0]  # the evaluation's own stream of training batches
    assert len(y) == 4
    ref = as_module(ctx.model, glob)
    opt = TwoRateSGD(ref.parameters(), 0.1)
    opt.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    opt.step()  # alpha = lr; PFLlib's second (beta) step on another batch is the recorded difference
    assert_params_close(alg.eval_params(state), params_in(ref))
    assert max(float((params_in(ref)[k] - glob[k]).abs().max()) for k in glob) > 1e-3
    torch.testing.assert_close(state["model"], glob)  # training starts from the received model

"""Partner of the strict xfail ``test_partialfed_model_batches_from_a_zero_strategy_as_pfllibs_draft``
in ``tests/test_reference_global.py``: the same transcription of PFLlib c79e660's draft
(``clientpartial.py``: blend p + (g - p) * s, then plain SGD model batches) with the difference
docs/algorithms.md records applied (hard gates from the logits S = 0, one Gumbel draw per unit at
receipt, loading the chosen units of the global model once per round: s is 1 for a unit drawn
global, else 0, applied once before the model batches) is pflkit's default ``load = "round"``, so
that a third behaviour fails."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from helpers import batch_pairs, params_of
from test_reference_global import build, client, close, module_at, weights


def test_partialfed_model_batches_from_hard_gates_drawn_once_at_receipt():
    ctx = client(30, seed=10, lr=0.1)
    alg = build("partialfed", ctx, "partialfed.model_batches=8", "partialfed.strategy_batches=2")
    glob, local = params_of(ctx, 2), params_of(ctx, 3)
    state, _ = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)
    new, _, _ = alg.local_train({"global": glob}, state, ctx)
    # S = 0: argmax(S_u + G_u) with G = -log(-log(u)) monotone in u picks the larger uniform draw
    # of the client's "init" stream; column 0 is the global model
    u = torch.rand((len(ctx.units), 2), generator=ctx.generator("init"))
    use_global = (u[:, 0] > u[:, 1]).tolist()
    assert 0 < sum(use_global) < len(use_global)  # both kinds of unit
    s = {k: torch.ones(1) if flag else torch.zeros(1) for flag, (_, names) in zip(use_global, ctx.units) for k in names}
    model = module_at(ctx, local)
    g = module_at(ctx, glob)
    with torch.no_grad():  # the draft's blend, once at receipt with the hard gates
        for (k, p), pg in zip(model.named_parameters(), g.parameters()):
            p.copy_(p + (pg - p) * s[k])
    close(alg.eval_params(state), weights(model))  # the partially initialised model is scored
    opt = torch.optim.SGD(model.parameters(), lr=ctx.train.lr)
    batches = batch_pairs(ctx, "train", 1)
    assert len(batches) == 3  # all model batches (f_m = 8)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    close(new["model"], weights(model))

"""FedROD: the personal head on detached features and the summed head
(docs/reference/methods/fedrod.md), the model its adaptability metrics score, and the client against
my transcriptions of TsingZ0/PFLlib d832e76, ``system/flcore/clients/clientrod.py`` (clientbase.py:
plain SGD) and Yutong-Dai/FedNH 60c3161, ``src/flbase/strategies/FedROD.py``
(FedRODClient._train_together)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.config import load_config
from pflkit.run.experiment import run_experiment
from tests.support.builders import batch_pairs, build, params_of, seeded_client, tiny_context
from tests.support.checks import ATOL, RTOL, assert_expected_close
from tests.support.references import BODY, module_at, weights


def test_fedrod_trains_the_personal_head_on_detached_features_and_scores_the_summed_head():
    ctx = tiny_context(n_train=20)
    glob = params_of(ctx, 2)
    alg = build("fedrod", ctx)
    state = alg.init_client(glob, 0)
    state, _ = alg.local_init({"global": glob}, state, ctx)
    new, upload, _ = alg.local_train({"global": glob}, state, ctx)
    assert set(upload["params"]) == set(glob)
    head = ["fc.weight", "fc.bias"]
    assert any(not torch.equal(new["personal"][k], glob[k]) for k in head)
    ev = alg.eval_params(new)
    for k in head:
        torch.testing.assert_close(ev[k], new["model"][k] + new["personal"][k])


@pytest.mark.integration
def test_fedrods_adaptability_metrics_score_its_uploaded_generic_model(monkeypatch, tmp_path):
    """FedACD's Tables 3 and 9 score each client's local model, the one it uploads: FedROD's generic
    model (body and W_g), not its personalised head W_g + W_p."""
    from pflkit.federation.evaluation import AdaptabilityMetrics

    scored = []
    real = AdaptabilityMetrics.__call__
    monkeypatch.setattr(
        AdaptabilityMetrics,
        "__call__",
        lambda self, setup, client_id, params: scored.append(params) or real(self, setup, client_id, params),
    )
    uploads = []
    real_upload = build("fedrod", tiny_context()).__class__.upload
    monkeypatch.setattr(
        type(build("fedrod", tiny_context())),
        "upload",
        staticmethod(lambda params, ctx, **extra: uploads.append(dict(params)) or real_upload(params, ctx, **extra)),
    )
    config = load_config(
        None,
        [
            "dataset=synthetic",
            "num_clients=3",
            "alpha=0.5",
            "rounds=1",
            "lr=0.05",
            "test_set=official",
            "metrics.adaptability=true",
            'algorithms=["fedrod"]',
            "engine=loop",
        ],
    )
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    assert len(scored) == len(uploads) == 3
    for params, upload in zip(scored, uploads):
        assert params.keys() == upload.keys()
        assert all(torch.equal(params[k], upload[k]) for k in params)
    ctx = tiny_context()
    alg = build("fedrod", ctx)
    state = alg.init_client(params_of(ctx, 1), 0)
    state["personal"] = {k: v + 1.0 for k, v in state["personal"].items()}
    assert alg.local_model(state) is state["model"]
    assert not torch.equal(alg.eval_params(state)["fc.weight"], state["model"]["fc.weight"])


# ============================================================================ PFLlib and FedNH


def balanced_softmax_reference(y, logits, sample_per_class) -> torch.Tensor:
    """balanced_softmax_loss of both references: CE(logits + log n_j) (mean); log 0 = -inf."""
    return F.cross_entropy(logits + sample_per_class.to(logits.dtype).log()[None, :], y)


def fedrod_reference_client(
    ctx,
    glob: dict,
    personal: dict,
    *,
    generic_momentum: float = 0.0,
    generic_weight_decay: float = 0.0,
    clip: float | None = None,
):
    """My transcription of PFLlib clientrod.py train() (d832e76): per batch rep = base(x),
    out_g = head(rep); the balanced-softmax loss steps the model (body + generic head) with its SGD;
    then out_p = personal_head(rep.detach()) and CE(out_g.detach() + out_p) steps the personal head
    with its own plain SGD (lr only). The personal head starts as a copy of the initial head.
    FedNH's FedRODClient._train_together (60c3161) is the same loop with the generic optimiser of
    setup_optimizer (momentum, weight decay) and clip_grad_norm_(max_norm=10) before its step
    (``generic_momentum``, ``generic_weight_decay``, ``clip``); its personal head optimiser is
    also plain SGD at the same lr."""
    model = module_at(ctx.model, glob)
    p_head = nn.Linear(64, 10)
    with torch.no_grad():
        p_head.weight.copy_(personal["fc.weight"])
        p_head.bias.copy_(personal["fc.bias"])
    spc = torch.bincount(ctx.data.train_y, minlength=10).float()
    opt = torch.optim.SGD(
        model.parameters(), lr=ctx.train.lr, momentum=generic_momentum, weight_decay=generic_weight_decay
    )
    opt_head = torch.optim.SGD(p_head.parameters(), lr=ctx.train.lr)
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        rep = model(x, stop=BODY)
        out_g = model(rep, start=BODY)
        opt.zero_grad()
        balanced_softmax_reference(y, out_g, spc).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm=clip)
        opt.step()
        out_p = p_head(rep.detach())
        opt_head.zero_grad()
        F.cross_entropy(out_g.detach() + out_p, y).backward()
        opt_head.step()
    return model, p_head


def test_fedrod_matches_pfllibs_two_optimisers_per_batch_and_scores_the_summed_logits():
    ctx = seeded_client(40, seed=5, classes=[0, 2, 3, 5, 8, 9], lr=0.1, epochs=2)  # four classes absent: log 0
    alg = build("fedrod", ctx)
    init, glob = params_of(ctx, 1), params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(init, 0), ctx)
    new, upload, _ = alg.local_train({"global": glob}, state, ctx)
    model, p_head = fedrod_reference_client(ctx, glob, init)
    assert_expected_close(new["model"], weights(model))
    assert_expected_close(upload["params"], weights(model))
    assert_expected_close(new["personal"], {"fc.weight": p_head.weight.detach(), "fc.bias": p_head.bias.detach()})
    assert not torch.equal(new["personal"]["fc.weight"], init["fc.weight"])
    # PFLlib's test_metrics scores out_g + out_p on the generic body's features
    x = ctx.data.test_x
    with torch.no_grad():
        theirs = model(x, start=0, stop=BODY)
        theirs = model(theirs, start=BODY) + p_head(theirs)
    ours = ctx.net(alg.eval_params(new), x, train=False)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


def test_fedrod_personal_head_plain_sgd_under_momentum_as_fednh():
    # FedACD's configs: momentum 0.9, weight decay 1e-5; FedNH's generic optimiser has both, its p_head one neither
    ctx = seeded_client(40, seed=5, classes=[0, 2, 3, 5, 8, 9], lr=0.05, momentum=0.9, weight_decay=1e-5, epochs=2)
    alg = build("fedrod", ctx)
    init, glob = params_of(ctx, 1), params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(init, 0), ctx)
    new, _, _ = alg.local_train({"global": glob}, state, ctx)
    model, p_head = fedrod_reference_client(ctx, glob, init, generic_momentum=0.9, generic_weight_decay=1e-5, clip=10.0)
    assert_expected_close(new["model"], weights(model))  # the generic part agrees (the clip at 10 is inactive here)
    assert_expected_close(new["personal"], {"fc.weight": p_head.weight.detach(), "fc.bias": p_head.bias.detach()})

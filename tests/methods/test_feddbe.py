"""FedDBE: the client, the initialisation pass and the scored model against my transcription of the
authors' code, TsingZ0/DBE 193f435, ``system/flcore/clients/clientDBE.py`` (train, test_metrics)
and ``system/flcore/servers/serverDBE.py`` (the initialisation period in __init__); PFLlib
d832e76's ``clientdbe.py``/``serverdbe.py`` are the same code."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms.feddbe import BIAS, MEAN
from tests.support.builders import batch_pairs, build, params_of, perturbed, seeded_client, summaries
from tests.support.checks import ATOL, RTOL, assert_expected_close
from tests.support.references import BODY, module_at, weights


def authors_client_train(ctx, glob, client_mean, global_mean, klw: float, momentum: float):
    """clientDBE.train: plain SGD on the model and on client_mean (lr each); running_mean reset to 0;
    per batch rep = base(x), running_mean = (1 - mo) running_mean + mo mean(rep); with a global
    mean: loss = CE(head(rep + client_mean)) + klw mean(0.5 (running_mean - global_mean)^2), else
    CE(head(rep)); both optimisers step; running_mean detached."""
    model = module_at(ctx.model, glob)
    mean = nn.Parameter(client_mean.clone())
    opt, opt_mean = torch.optim.SGD(model.parameters(), lr=ctx.train.lr), torch.optim.SGD([mean], lr=ctx.train.lr)
    running = torch.zeros_like(client_mean)
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        rep = model(x, stop=BODY)
        running = (1 - momentum) * running + momentum * torch.mean(rep, dim=0)
        if global_mean is not None:
            reg = torch.mean(0.5 * (running - global_mean) ** 2)
            loss = F.cross_entropy(model(rep + mean, start=BODY), y) + reg * klw
        else:
            loss = F.cross_entropy(model(rep, start=BODY), y)
        opt_mean.zero_grad()
        opt.zero_grad()
        loss.backward()
        opt.step()
        opt_mean.step()
        running = running.detach()
    return weights(model), mean.detach(), running


def pflkit_round(ctx, glob, bias, global_mean, *overrides):
    alg = build("feddbe", ctx, *overrides)
    state = alg.init_client(params_of(ctx, 9), 0)
    state["between"] = {BIAS.name("bias"): bias.clone()}
    server = {"global": glob, **({MEAN: global_mean} if global_mean is not None else {})}
    payload = alg.downlink(server, 0, 2)
    state, _ = alg.local_init(payload, state, ctx)
    return alg, alg.local_train(payload, state, ctx)


@pytest.mark.parametrize(
    "overrides,klw,mo", [((), 50.0, 1.0), (("feddbe.kappa=20.0", "feddbe.momentum=0.3"), 20.0, 0.3)]
)
def test_feddbe_client_is_the_authors_train(overrides, klw, mo):
    ctx = seeded_client(40, seed=3, lr=0.05, epochs=2, round=2)
    glob = params_of(ctx, 2)
    bias = 0.3 * torch.randn(64, generator=torch.Generator().manual_seed(1))
    global_mean = torch.rand(64, generator=torch.Generator().manual_seed(2))
    _, (new, upload, _) = pflkit_round(ctx, glob, bias, global_mean, *overrides)
    model, mean, _ = authors_client_train(ctx, glob, bias, global_mean, klw, mo)
    assert_expected_close(new["model"], model)
    assert_expected_close(upload["params"], model)
    torch.testing.assert_close(new["between"][BIAS.name("bias")], mean, rtol=RTOL, atol=ATOL)
    assert set(upload) == {"params", "num_samples"}  # c stays on the client
    # the regulariser matters here
    without, _, _ = authors_client_train(ctx, glob, bias, global_mean, 0.0, mo)
    assert any(not torch.allclose(model[k], without[k], atol=1e-4) for k in model)


def test_feddbe_first_round_is_the_authors_initialisation_pass():
    """serverDBE.__init__: every client trains on plain CE from the initial model; the server sets
    global_mean = sum_i n_i / n running_mean_i; the trained models are overwritten by the next
    send_models (the server's model is still the initial one)."""
    ctxs = [seeded_client(30, seed=1, client_id=0, lr=0.05), seeded_client(20, seed=2, client_id=1, lr=0.05)]
    glob = params_of(ctxs[0], 2)
    alg = build("feddbe", ctxs[0], "feddbe.momentum=0.5")
    server = alg.prepare(alg.init_server(glob), summaries([30, 20]), 0)
    uploads, expected = [], 0
    for i, ctx in enumerate(ctxs):
        payload = alg.downlink(server, i, 1)
        assert MEAN not in payload
        state, _ = alg.local_init(payload, alg.init_client(glob, i), ctx)
        new, upload, _ = alg.local_train(payload, state, ctx)
        model, mean, running = authors_client_train(ctx, glob, torch.zeros(64), None, 50.0, 0.5)
        assert_expected_close(new["model"], model)
        assert torch.equal(new["between"][BIAS.name("bias")], torch.zeros(64))  # no DBE in this pass
        uploads.append({**upload, "num_samples": int(upload["num_samples"]), "client_id": i})
        expected = expected + ctx.num_train / 50 * running
    after = alg.aggregate(server, uploads, 1)
    torch.testing.assert_close(after[MEAN], expected, rtol=RTOL, atol=ATOL)
    assert all(torch.equal(after["global"][k], glob[k]) for k in glob)
    assert MEAN in alg.downlink(after, 0, 2)
    # later rounds: FedAvg's average, m_g unchanged
    later = alg.aggregate(after, [{**u, "params": perturbed(u["params"], i, 0.1)} for i, u in enumerate(uploads)], 2)
    assert torch.equal(later[MEAN], after[MEAN])
    assert not torch.equal(later["global"]["fc.weight"], glob["fc.weight"])


def test_feddbe_scores_the_head_on_features_plus_the_personal_bias():
    """clientDBE.test_metrics: output = head(base(x) + client_mean)."""
    ctx = seeded_client(20, seed=4)
    alg = build("feddbe", ctx)
    state = alg.init_client(params_of(ctx, 3), 0)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(5))
    state["between"] = {BIAS.name("bias"): bias}
    x = ctx.data.test_x
    model = module_at(ctx.model, state["model"])
    with torch.no_grad():
        theirs = model(model(x, stop=BODY) + bias, start=BODY)
    ours = ctx.net(alg.eval_params(state), x, train=False)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(ours, ctx.net(state["model"], x, train=False))


def test_feddbe_refuses_a_model_without_a_linear_head():
    from pflkit.models import build_model

    ctx = seeded_client(10)
    with pytest.raises(ValueError, match="linear head"):
        build("feddbe", ctx).check_model(build_model("squeezenet1_1", (3, 32, 32), 10))


@pytest.mark.integration
def test_feddbe_resumes_after_an_interruption_to_the_uninterrupted_numbers(tmp_path, fast_config):
    from pflkit.config import load_config
    from pflkit.run.experiment import resume_experiment, run_experiment
    from tests.support.runs import InterruptAfter, records_without_timings

    config = load_config(None, [*fast_config, 'algorithms=["feddbe"]', "rounds=4"])
    run_experiment(config, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):  # after round 2: the client state of rounds 1-2 must carry over
        run_experiment(
            config, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("feddbe", 2)]
        )
    resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    records = records_without_timings(tmp_path / "cut")
    assert records == records_without_timings(tmp_path / "full")
    assert [r["round"] for r in records if "round" in r][-1] == 4

"""FedBABU: against my transcriptions of PFLlib f1e313a (``clients/clientbabu.py``: ``train``,
``set_parameters``, ``fine_tune``; ``servers/serverbabu.py``) and of the authors' personalisation
(jhoon-oh/FedBABU e34c15b, ``analysis.ipynb``)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pflkit.models import head_names
from tests.support.builders import batch_pairs, build, client_context, params_of, tiny_context
from tests.support.checks import assert_params_close, moved
from tests.support.references import XFAIL_DIFFERS, network, pfllib_server_average, weights


def pfllib_babu_client(ctx, glob: dict, lr: float) -> dict:
    """clientbabu.py ``train``: torch.optim.SGD(lr) over ``model.base`` only, the predictor's
    requires_grad off, E epochs from the received model (``set_parameters`` copies the base; the
    predictor is every client's initial one)."""
    net = network(ctx, glob)
    head = set(head_names(ctx.units))
    for k, p in net.named_parameters():
        p.requires_grad_(k not in head)
    opt = torch.optim.SGD([p for k, p in net.named_parameters() if k not in head], lr=lr)
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return weights(net)


def test_fedbabu_round_is_pfllibs_body_training_and_body_average():
    ctxs = [tiny_context(n_train=30, seed=0, epochs=2), tiny_context(n_train=20, seed=1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    head = head_names(ctxs[0].units)
    alg = build("fedbabu", ctxs[0], "fedbabu.ft_epochs=1")
    server = alg.init_server(glob)
    payload = alg.downlink(server, 0, 1)
    uploads, bodies = [], []
    for i, ctx in enumerate(ctxs):
        state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 5 + i), i), ctx)
        assert moved(alg.eval_params(state), glob)  # scored: the fine-tuned model
        new, upload, _ = alg.local_train(payload, state, ctx)
        ref = pfllib_babu_client(ctx, glob, lr=0.1)  # from the received model, not the fine-tuned one
        assert_params_close(new["model"], ref)
        assert all(torch.equal(new["model"][k], glob[k]) for k in head)  # the head stays frozen
        assert set(upload["params"]) == set(glob) - set(head)  # serverbabu: model.base travels
        assert_params_close(upload["params"], {k: ref[k] for k in upload["params"]})
        uploads.append({**upload, "client_id": i})
        bodies.append({k: ref[k] for k in upload["params"]})
    out = alg.aggregate(server, uploads, 1)["global"]
    assert_params_close(out, {**glob, **pfllib_server_average(bodies, [30, 20])})
    assert all(torch.equal(out[k], glob[k]) for k in head)  # the head is never updated


def authors_personalisation(ctx, glob: dict, lr: float, momentum: float, epochs: int) -> dict:
    """analysis.ipynb: from the global model, ``personalization_epoch`` = 5 epochs of
    torch.optim.SGD over body and head at one lr, with momentum, CrossEntropyLoss per batch."""
    net = network(ctx, glob)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    for x, y in batch_pairs(ctx, "finetune", epochs):
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return weights(net)


def test_fedbabu_scores_the_authors_whole_model_fine_tuning():
    ctx = client_context(0, n_train=30, momentum=0.9, lr=0.1, rounds=1)
    glob = params_of(ctx, 2)
    alg = build("fedbabu", ctx, "fedbabu.ft_lr=0.01")
    assert alg.settings.ft_epochs == 5
    state, metrics = alg.local_init({"global": glob}, alg.init_client(params_of(ctx, 3), 0), ctx)
    ref = authors_personalisation(ctx, glob, lr=0.01, momentum=0.9, epochs=5)
    assert_params_close(alg.eval_params(state), ref)
    head = head_names(ctx.units)
    assert moved({k: ref[k] for k in head}, {k: glob[k] for k in head})  # the head is fine-tuned too
    head_only = build("fedbabu", ctx, "fedbabu.ft_lr=0.01", 'fedbabu.ft_part="head"')
    state, _ = head_only.local_init({"global": glob}, head_only.init_client(glob, 0), ctx)
    tuned = head_only.eval_params(state)
    assert all(torch.equal(tuned[k], glob[k]) for k in glob if k not in head)
    assert moved({k: tuned[k] for k in head}, {k: glob[k] for k in head})


def pfllib_fine_tune(ctx, glob: dict, lr: float) -> dict:
    """clientbabu.py ``fine_tune`` (default which_module: base and predictor; fine_tuning_steps = 1):
    the predictor's requires_grad is switched on, but the client's optimiser holds ``model.base`` only."""
    net = network(ctx, glob)
    opt = torch.optim.SGD([p for k, p in net.named_parameters() if k not in head_names(ctx.units)], lr=lr)
    for x, y in batch_pairs(ctx, "finetune", 1):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return weights(net)


@XFAIL_DIFFERS(reason="PFLlib's fine-tuning optimiser holds the body alone; the authors fine-tune the head too")
def test_fedbabu_fine_tuning_is_pfllibs():
    ctx = tiny_context(n_train=30, seed=0)
    glob = params_of(ctx, 2)
    alg = build("fedbabu", ctx, "fedbabu.ft_epochs=1")
    state, _ = alg.local_init({"global": glob}, alg.init_client(glob, 0), ctx)
    assert_params_close(alg.eval_params(state), pfllib_fine_tune(ctx, glob, lr=0.1))


@pytest.mark.integration
def test_fedbabu_resumes_after_an_interruption_to_the_uninterrupted_numbers(tmp_path, fast_config):
    from pflkit.config import load_config
    from tests.support.runs import assert_resumes_to_the_uninterrupted_records

    config = load_config(None, [*fast_config, 'algorithms=["fedbabu", "fedbabu+ala"]', "rounds=3"])
    assert_resumes_to_the_uninterrupted_records(config, tmp_path, "fedbabu")

"""FedAvg, FedProx, Ditto, FedRep and pFedMe against my transcriptions of PFLlib (TsingZ0/PFLlib f1e313a).

Each ``pfllib_*`` function below is written from reading the reference files named in its docstring
(not copied): a ``torch.nn.Module`` copy of the client's network driven by ``torch.optim.SGD`` or an
explicit per-parameter update loop in the reference's order of steps, on the very mini-batches that
pflkit's context hands its training (``batch_pairs``). PFLlib's loader reshuffles every epoch and
drops the last partial batch, as pflkit's does (docs/design.md, "training loader").
"""

from __future__ import annotations

import copy

import torch
from torch.nn import functional as F

from pflkit.config import load_config
from pflkit.methods import build_algorithm

from helpers import batch_pairs, params_of, tiny_context

RTOL, ATOL = 1e-5, 1e-6


def build(name: str, ctx, *overrides: str):
    return build_algorithm(name, load_config(None, list(overrides)).algorithm_sections(), ctx.train, ctx.units)


def client(n_train: int, seed: int, epochs: int = 1, lr: float = 0.1, batch_size: int = 10):
    ctx = tiny_context(n_train=n_train, seed=seed, lr=lr, batch_size=batch_size)
    ctx.train = ctx.train.model_copy(update={"local_epochs": epochs})
    return ctx


def close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=RTOL, atol=ATOL, msg=k)


def moved(a: dict, b: dict) -> bool:
    return any(not torch.allclose(a[k], b[k], rtol=0, atol=1e-4) for k in a)


# ---- the reference, transcribed ----------------------------------------------------------------
def network(ctx, params: dict) -> torch.nn.Module:
    """A fresh nn.Module of the client's architecture holding ``params`` (PFLlib's ``set_parameters``
    copies the received tensors into the client's module)."""
    net = copy.deepcopy(ctx.model)
    net.load_state_dict({k: v.detach().clone() for k, v in params.items()}, strict=True)
    net.train()
    return net


def weights_of(net: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in net.named_parameters()}


def pfllib_sgd_epochs(net: torch.nn.Module, batches, lr: float, params=None) -> None:
    """clientavg.py ``train``: per batch zero_grad, CrossEntropyLoss, backward, torch.optim.SGD(lr).step
    (an optimiser over ``params``: all of the model by default)."""
    opt = torch.optim.SGD(net.parameters() if params is None else params, lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()


def pfllib_server_average(models: list[dict], train_samples: list[int]) -> dict:
    """serverbase.py ``receive_models`` + ``aggregate_parameters``: weights n_i / sum_j n_j over the
    selected clients; start from zeros and add each client's tensor times its weight."""
    total = sum(train_samples)
    out = {k: torch.zeros_like(v) for k, v in models[0].items()}
    for model, n in zip(models, train_samples):
        for k in out:
            out[k] += model[k].clone() * (n / total)
    return out


def pfllib_perturbed_epochs(net: torch.nn.Module, anchor: dict, batches, lr: float, mu: float) -> None:
    """fedoptimizer.py ``PerturbedGradientDescent.step`` after CE backward: every parameter moves by
    -lr * (its gradient + mu * (itself - the anchor tensor))."""
    for x, y in batches:
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for k, p in net.named_parameters():
                p.add_(p.grad + mu * (p - anchor[k]), alpha=-lr)


def pfllib_fedavg_client(ctx, glob: dict, lr: float) -> dict:
    net = network(ctx, glob)
    pfllib_sgd_epochs(net, batch_pairs(ctx, "train", ctx.train.local_epochs), lr)
    return weights_of(net)


def pfllib_fedprox_client(ctx, glob: dict, lr: float, mu: float) -> dict:
    """clientprox.py: ``set_parameters`` stores the received tensors as ``global_params`` and loads
    them; ``train`` runs E epochs of PerturbedGradientDescent toward ``global_params``."""
    anchor = {k: v.clone() for k, v in glob.items()}
    net = network(ctx, glob)
    pfllib_perturbed_epochs(net, anchor, batch_pairs(ctx, "train", ctx.train.local_epochs), lr, mu)
    return weights_of(net)


def pfllib_ditto_client(ctx, glob: dict, personal: dict, lr: float, mu: float, plocal: int) -> tuple[dict, dict]:
    """serverditto.py calls ``ptrain`` then ``train`` on every selected client after ``send_models``.
    clientditto.py ``ptrain``: plocal_steps epochs of PerturbedGradientDescent (same lr) on the
    persistent pmodel, anchored at ``self.model``'s parameters, i.e. the just-received global;
    ``train``: E epochs of plain SGD on ``self.model`` from the received global, which is uploaded."""
    model = network(ctx, glob)
    pmodel = network(ctx, personal)
    pfllib_perturbed_epochs(pmodel, weights_of(model), batch_pairs(ctx, "personal", plocal), lr, mu)
    pfllib_sgd_epochs(model, batch_pairs(ctx, "train", ctx.train.local_epochs), lr)
    return weights_of(model), weights_of(pmodel)


def pfllib_fedrep_client(ctx, body: dict, head: dict, lr: float, head_epochs: int) -> dict:
    """clientrep.py ``train``: freeze the base, plocal_steps epochs of SGD (poptimizer, same lr) on
    the predictor (the last layer, main.py: ``args.model.fc``); then freeze the predictor and run E
    epochs of SGD (optimizer over the base). ``set_parameters`` only replaces the base."""
    net = network(ctx, {**body, **head})
    head_params = [p for k, p in net.named_parameters() if k in head]
    body_params = [p for k, p in net.named_parameters() if k in body]
    for p in body_params:
        p.requires_grad_(False)
    pfllib_sgd_epochs(net, batch_pairs(ctx, "head", head_epochs), lr, head_params)
    for p in body_params:
        p.requires_grad_(True)
    for p in head_params:
        p.requires_grad_(False)
    pfllib_sgd_epochs(net, batch_pairs(ctx, "train", ctx.train.local_epochs), lr, body_params)
    return weights_of(net)


def pfllib_pfedme_client(ctx, glob: dict, lr: float, plr: float, lam: float, K: int,
                         mu: float = 0.001) -> tuple[dict, dict]:
    """clientpFedMe.py ``train`` with fedoptimizer.py ``pFedMeOptimizer`` (its mu = 0.001 default,
    never overridden by the client). theta lives in the model's parameters, starts at the received
    global (``set_parameters``) and persists across batches and epochs; w = ``local_params`` starts
    at the received global too. Per batch: K times {CE backward at theta; theta <- theta - plr *
    (grad + lam (theta - w) + mu theta)}; then w <- w - lam * lr * (w - theta). The model is finally
    overwritten with w, which is uploaded."""
    net = network(ctx, glob)
    w = {k: v.clone() for k, v in glob.items()}
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        for _ in range(K):
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
            with torch.no_grad():
                for k, theta in net.named_parameters():
                    theta.copy_(theta - plr * (theta.grad + lam * (theta - w[k]) + mu * theta))
        with torch.no_grad():
            for k, theta in net.named_parameters():
                w[k] = w[k] - lam * lr * (w[k] - theta)
    return w, weights_of(net)


def pfllib_pfedme_server(previous: dict, models: list[dict], train_samples: list[int], beta: float) -> dict:
    """serverpFedMe.py: keep the previous global, FedAvg-aggregate (serverbase), then
    ``beta_aggregate_parameters``: (1 - beta) * previous + beta * aggregate."""
    avg = pfllib_server_average(models, train_samples)
    return {k: (1 - beta) * previous[k] + beta * avg[k] for k in avg}


# ---- the tests ---------------------------------------------------------------------------------
def two_client_round(name: str, ctxs, glob: dict, *overrides: str):
    """pflkit's round on two clients (sizes 30 and 20) from ``glob``: downlink, local_init, local_train,
    aggregate. Returns (server after aggregation, per-client trained states, uploads)."""
    alg = build(name, ctxs[0], *overrides)
    server = alg.init_server(glob)
    states, uploads = [], []
    for i, ctx in enumerate(ctxs):
        payload = alg.downlink(server, i, 1)
        state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 7 + i), i), ctx)
        new, upload, _ = alg.local_train(payload, state, ctx)
        states.append(new)
        uploads.append({**upload, "client_id": i})
    return alg, alg.aggregate(server, uploads, 1), states, uploads


def test_fedavg_is_pfllib_clientavg_sgd_and_serverbase_sample_weighted_average():
    ctxs = [client(30, 0, epochs=2), client(20, 1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    alg, server, states, uploads = two_client_round("fedavg", ctxs, glob)
    expected = [pfllib_fedavg_client(ctx, glob, lr=0.1) for ctx in ctxs]
    for state, upload, ref in zip(states, uploads, expected):
        close(state["model"], ref)
        close(upload["params"], ref)
    assert [u["num_samples"] for u in uploads] == [30, 20]  # PFLlib: train_samples = len(train_data)
    assert moved(expected[0], glob) and moved(expected[0], expected[1])
    close(server["global"], pfllib_server_average(expected, [30, 20]))
    # PFLlib evaluates every client on the just-sent global model (serveravg.py: send_models, evaluate)
    state, _ = alg.local_init(alg.downlink(server, 0, 2), alg.init_client(params_of(ctxs[0], 9), 0), ctxs[0])
    close(alg.eval_params(state), server["global"])


def test_fedprox_is_pfllib_perturbed_gradient_descent_toward_the_received_global():
    ctxs = [client(30, 0, epochs=2), client(20, 1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    mu = 0.5  # large enough that the proximal term changes the result far beyond the tolerance
    _, server, states, uploads = two_client_round("fedprox", ctxs, glob, f"fedprox.mu={mu}")
    expected = [pfllib_fedprox_client(ctx, glob, lr=0.1, mu=mu) for ctx in ctxs]
    for state, upload, ref in zip(states, uploads, expected):
        close(state["model"], ref)
        close(upload["params"], ref)
    assert moved(expected[0], pfllib_fedavg_client(ctxs[0], glob, lr=0.1))  # the term matters here
    close(server["global"], pfllib_server_average(expected, [30, 20]))


def test_ditto_is_pfllib_ptrain_then_train_with_the_personal_model_anchored_at_the_received_global():
    ctx = client(30, 0, epochs=2)
    glob, old_personal, old_model = params_of(ctx, 2), params_of(ctx, 3), params_of(ctx, 4)
    mu, plocal = 0.5, 2
    alg = build("ditto", ctx, f"ditto.mu={mu}", f"ditto.personal_epochs={plocal}")
    state = {**alg.init_client(old_model, 0), "personal": old_personal}
    state, _ = alg.local_init({"global": glob}, state, ctx)
    close(alg.eval_params(state), old_personal)  # PFLlib's test_metrics score the pmodel
    new, upload, _ = alg.local_train({"global": glob}, state, ctx)
    ref_model, ref_personal = pfllib_ditto_client(ctx, glob, old_personal, lr=0.1, mu=mu, plocal=plocal)
    close(new["personal"], ref_personal)
    close(new["model"], ref_model)
    close(upload["params"], ref_model)
    close(alg.eval_params(new), ref_personal)
    # the anchor is the received global, not the old local model; and the term matters
    wrong_anchor = network(ctx, old_personal)
    pfllib_perturbed_epochs(wrong_anchor, old_model, batch_pairs(ctx, "personal", plocal), 0.1, mu)
    assert moved(ref_personal, weights_of(wrong_anchor))
    # server: FedAvg's aggregate_parameters over the uploaded global-track models
    ctx2 = client(20, 1, epochs=2)
    state2, _ = alg.local_init({"global": glob}, alg.init_client(params_of(ctx2, 5), 1), ctx2)
    _, upload2, _ = alg.local_train({"global": glob}, state2, ctx2)
    ref2, _ = pfllib_ditto_client(ctx2, glob, params_of(ctx2, 5), lr=0.1, mu=mu, plocal=plocal)
    out = alg.aggregate(alg.init_server(glob), [{**upload, "client_id": 0}, {**upload2, "client_id": 1}], 1)
    close(out["global"], pfllib_server_average([ref_model, ref2], [30, 20]))


def test_fedrep_is_pfllib_head_epochs_then_body_epochs_and_a_body_only_server():
    ctxs = [client(30, 0, epochs=2), client(20, 1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    head_epochs = 2
    alg = build("fedrep", ctxs[0], f"fedrep.head_epochs={head_epochs}", "fedrep.clip_norm=0")  # PFLlib: no clip
    assert alg.settings.clip_norm == 0  # pflkit's optional clipping is off: PFLlib has none
    head_names = [k for k in glob if k.startswith("fc.")]
    body_names = [k for k in glob if k not in head_names]
    server = alg.init_server(glob)
    payload = alg.downlink(server, 0, 1)
    assert sorted(payload["global"]) == sorted(body_names)  # clientrep.set_parameters: base only
    expected, uploads, heads = [], [], []
    for i, ctx in enumerate(ctxs):
        local = params_of(ctx, 7 + i)  # a client's own head from earlier rounds
        state, _ = alg.local_init(payload, alg.init_client(local, i), ctx)
        body = {k: glob[k] for k in body_names}
        head = {k: local[k] for k in head_names}
        close(alg.eval_params(state), {**body, **head})  # scored: (global body, local head)
        new, upload, _ = alg.local_train(payload, state, ctx)
        ref = pfllib_fedrep_client(ctx, body, head, lr=0.1, head_epochs=head_epochs)
        close(new["model"], ref)
        close(upload["params"], {k: ref[k] for k in body_names})  # serverrep.receive_models: model.base
        expected.append({k: ref[k] for k in body_names})
        heads.append({k: ref[k] for k in head_names})
        uploads.append({**upload, "client_id": i})
    assert moved(heads[0], {k: params_of(ctxs[0], 7)[k] for k in head_names})
    out = alg.aggregate(server, uploads, 1)
    close({k: out["global"][k] for k in body_names}, pfllib_server_average(expected, [30, 20]))
    # next round: the new body arrives, each client keeps its trained head
    state, _ = alg.local_init(alg.downlink(out, 0, 2), {"model": {**expected[0], **heads[0]}}, ctxs[0])
    close(alg.eval_params(state), {**{k: out["global"][k] for k in body_names}, **heads[0]})


def test_pfedme_is_pfllib_inner_steps_with_its_l2_term_local_update_and_beta_server():
    ctxs = [client(30, 0, epochs=2), client(20, 1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    lam, plr, K, beta = 15.0, 0.01, 5, 0.5
    # pflkit's default l2 = 0 drops the reference's 0.001 * theta (documented); l2 = 0.001 restores it
    alg, server, states, uploads = two_client_round(
        "pfedme", ctxs, glob, f"pfedme.lam={lam}", f"pfedme.personal_lr={plr}", f"pfedme.inner_steps={K}",
        f"pfedme.beta={beta}", "pfedme.l2=0.001")
    assert alg.settings.server_weights == "samples" and alg.settings.theta_init == "received"
    expected_w, expected_theta = [], []
    for ctx, state, upload in zip(ctxs, states, uploads):
        w, theta = pfllib_pfedme_client(ctx, glob, lr=0.1, plr=plr, lam=lam, K=K)
        close(state["model"], w)
        close(upload["params"], w)
        close(state["personal"], theta)  # pflkit scores theta (documented: PFLlib scores the global)
        expected_w.append(w)
        expected_theta.append(theta)
    assert moved(expected_w[0], expected_theta[0]) and moved(expected_w[0], glob)
    close(server["global"], pfllib_pfedme_server(glob, expected_w, [30, 20], beta))

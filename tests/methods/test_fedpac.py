"""FedPAC against my transcriptions of the authors' code (JianXu95/FedPAC, commit 5770f4f):
``methods/fedpac.py`` (``LocalUpdate_FedPAC``: ``statistics_extraction``, ``get_local_protos``,
``local_training``), ``tools.py`` (``protos_aggregation``, ``average_weights_weighted``,
``get_head_agg_weight``, ``agg_classifier_weighted_p``) and ``running.py`` (``train_round_fedpac``).

The authors solve each client's quadratic programme with cvxpy; the weights below were computed by my
transcription of ``get_head_agg_weight`` with numpy (their ``torch.eig`` no longer exists) and cvxpy
1.9.3 (its default solver for this problem, OSQP), and the round test solves the transcription's
matrices with pflkit's scipy solver, which the fixed example checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pflkit.algorithms.fedpac import (
    HEADS,
    PROTOS,
    SEEN,
    collaboration_weights,
    combine,
    feature_moments,
    feature_statistics,
    simplex_qp,
)
from pflkit.config import load_config
from pflkit.models import build_model
from tests.support.builders import batch_pairs, build, client_context, params_of, summaries
from tests.support.checks import assert_expected_close, moved
from tests.support.references import BODY, module_at, weights

HEAD = ("fc.weight", "fc.bias")

# ============================================================================ the quadratic programme
# a fixed example: 5 clients, 3 classes, 4 features; clients 0 and 1, 2 and 3 have close statistics
VARS = [0.3, 0.1, 0.5, 0.2, 0.05]
HS = [
    [[0.0006, 0.1494, -0.1371, -0.4453], [-0.2273, -0.4958, 0.0301, 0.6701], [-0.2461, -0.3102, 0.2449, 0.1784]],
    [[0.0108, 0.1262, -0.1307, -0.5047], [-0.2563, -0.5056, 0.075, 0.7274], [-0.3123, -0.35, 0.2773, 0.0788]],
    [[0.0784, -0.0935, -1.2584, -0.2693], [-0.0243, 0.0567, -0.7651, -0.2389], [-0.4893, -0.4044, 0.5304, -0.4038]],
    [[0.0321, -0.1032, -1.1327, -0.2004], [-0.057, 0.0198, -0.7901, -0.0865], [-0.5321, -0.4348, 0.5657, -0.4158]],
    [[-0.3207, 1.0002, 0.3811, -0.5996], [0.0373, 0.2883, -0.0944, 0.3415], [-0.0333, 0.3336, 0.7193, -0.3378]],
]
# get_head_agg_weight(5, VARS, HS) with cvxpy's solution, weights <= 1e-3 zeroed
CVXPY_WEIGHTS = [
    [0.2791495, 0.6660841, 0.0094501, 0.0142829, 0.0310334],
    [0.2219195, 0.7425394, 0.0, 0.0167991, 0.0187419],
    [0.0, 0.0, 0.3359645, 0.6596985, 0.004337],
    [0.0095219, 0.0427407, 0.2653929, 0.6770018, 0.0053427],
    [0.0051722, 0.0093991, 0.0, 0.0013357, 0.9832764],
]


def authors_qp_matrices(vars_: list[float], hs: list[torch.Tensor]) -> list[np.ndarray]:
    """get_head_agg_weight's matrix per client i: diag(V) + dist, dist[j1][j2] the trace of
    sum_k (h_i[k] - h_j1[k])(h_i[k] - h_j2[k])^T, over the pairs j1 <= j2 (float32, as theirs)."""
    m, (num_cls, d) = len(hs), hs[0].shape
    out = []
    for i in range(m):
        v, h_ref = torch.tensor(vars_), hs[i]
        dist = torch.zeros((m, m))
        for j1 in range(m):
            for j2 in range(j1, m):
                h = torch.zeros((d, d))
                for k in range(num_cls):
                    h += torch.mm((h_ref[k] - hs[j1][k]).reshape(d, 1), (h_ref[k] - hs[j2][k]).reshape(1, d))
                dist[j1][j2] = dist[j2][j1] = torch.trace(h)
        out.append((torch.diag(v) + dist).numpy())
    return out


def test_fedpac_quadratic_programme_matches_cvxpy_on_a_fixed_example():
    rows = np.array(HS, dtype=np.float64).reshape(len(HS), -1)
    ours = collaboration_weights(np.array(VARS), rows, 1e-3)
    for got, expected in zip(ours, CVXPY_WEIGHTS):
        assert got is not None
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    # the transcription's float32 matrices give the same weights
    for p, expected in zip(authors_qp_matrices(VARS, [torch.tensor(h) for h in HS]), CVXPY_WEIGHTS):
        a = simplex_qp(p.astype(np.float64))
        assert a is not None
        np.testing.assert_allclose(np.where(a > 1e-3, a, 0.0), expected, atol=1e-4, rtol=0)


def test_the_simplex_programme_meets_its_optimality_conditions():
    """At the minimiser of a^T P a on the simplex the gradient 2 P a is the same, lambda, on the
    support and at least lambda off it (KKT), whatever the solver."""
    g = np.random.default_rng(0)
    for m in (2, 4, 9):
        b = g.normal(size=(m, 3))
        p = b @ b.T + np.diag(g.uniform(0.01, 0.2, m))
        a = simplex_qp(p)
        assert a is not None and a.min() >= 0 and a.sum() == pytest.approx(1.0)
        grad = 2 * p @ a
        support = a > 1e-6
        lam = grad[support].mean()
        np.testing.assert_allclose(grad[support], lam, rtol=1e-5, atol=1e-7)
        assert (grad[~support] >= lam - 1e-7).all()


def test_a_matrix_with_a_negative_eigenvalue_keeps_its_part_of_eigenvalues_of_at_least_one_hundredth():
    p = np.array([[1.0, 0.0], [0.0, -0.5]])  # keeps diag(1, 0): all weight on the free direction
    np.testing.assert_allclose(simplex_qp(p), [0.0, 1.0], atol=1e-6)
    assert simplex_qp(np.diag([0.005, -1.0])) is None  # nothing >= 0.01 remains: the client keeps its head


def test_a_head_combination_divides_by_the_sum_of_the_weights_left_after_zeroing():
    """agg_classifier_weighted_p: sum_j a_j g_j / sum_j a_j (the zeroed weights leave a sum below 1)."""
    heads = [{"fc.weight": torch.full((2, 3), 1.0)}, {"fc.weight": torch.full((2, 3), 4.0)}]
    combined = combine(heads, np.array([0.2, 0.05]))
    torch.testing.assert_close(combined["fc.weight"], torch.full((2, 3), 1.6))


# ============================================================================ the client
def train_batches(ctx) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The client's whole training set in loader batches (the authors' ``self.train_data``)."""
    x, y, b = ctx.data.train_x, ctx.data.train_y, ctx.train.batch_size
    return [(x[i : i + b], y[i : i + b]) for i in range(0, len(y), b)]


def authors_local_protos(net: nn.Module, ctx) -> dict[int, torch.Tensor]:
    """get_local_protos + tools.get_protos: per class the mean of the detached features."""
    lists: dict[int, list[torch.Tensor]] = {}
    for x, y in train_batches(ctx):
        protos = net(x, stop=BODY).clone().detach()
        for i in range(len(y)):
            lists.setdefault(y[i].item(), []).append(protos[i, :])
    means = {}
    for label, proto_list in lists.items():
        proto = 0 * proto_list[0]
        for p in proto_list:
            proto += p
        means[label] = proto / len(proto_list)
    return means


def authors_statistics(net: nn.Module, ctx, num_classes: int = 10) -> tuple[float, torch.Tensor]:
    """statistics_extraction: V and h_ref from the features of the whole training set."""
    total = len(ctx.data.train_y)
    py = torch.zeros(num_classes)
    for _, labels in train_batches(ctx):
        for i in range(num_classes):
            py[i] = py[i] + (i == labels).sum()
    py = py / total
    feature_dict: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        for x, y in train_batches(ctx):
            feat_batch = net(x, stop=BODY).clone().detach()
            for i in range(len(y)):
                feature_dict.setdefault(y[i].item(), []).append(feat_batch[i, :])
    stacked = {k: torch.stack(v) for k, v in feature_dict.items()}
    py2 = py.mul(py)
    d = net.fc.weight.shape[1]
    v, h_ref = 0.0, torch.zeros((num_classes, d))
    for k in range(num_classes):
        if k in stacked:
            feat_k = stacked[k]
            num_k = feat_k.shape[0]
            feat_k_mu = feat_k.mean(dim=0)
            h_ref[k] = py[k] * feat_k_mu
            v += (py[k] * torch.trace(torch.mm(torch.t(feat_k), feat_k) / num_k)).item()
            v -= (py2[k] * (torch.mul(feat_k_mu, feat_k_mu))).sum().item()
    return v / total, h_ref


def authors_local_training(ctx, params: dict, global_protos: dict, rnd: int, lam: float = 1.0, lr_g: float = 0.1):
    """local_training: the model in evaluation mode (local_test ran before); the local prototypes
    before training; 1 epoch of the head alone (SGD lr_g = 0.1), then E epochs of the body alone
    (SGD lr) on CE + lam MSE(features, the global prototype of the class, else the local one) for
    rnd > 0. The authors' optimisers have momentum 0.5 and weight decay 5e-4: the context's here."""
    net = module_at(ctx.model, params).eval()
    local_protos1 = authors_local_protos(net, ctx)
    momentum, decay = ctx.train.momentum, ctx.train.weight_decay
    for name, param in net.named_parameters():
        param.requires_grad = name in HEAD
    trained = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=lr_g, momentum=momentum, weight_decay=decay)
    for x, y in batch_pairs(ctx, "head", 1):
        net.zero_grad()
        nn.CrossEntropyLoss()(net(x), y).backward()
        opt.step()
    for name, param in net.named_parameters():
        param.requires_grad = name not in HEAD
    opt = torch.optim.SGD(
        [p for p in net.parameters() if p.requires_grad], lr=ctx.train.lr, momentum=momentum, weight_decay=decay
    )
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        net.zero_grad()
        protos = net(x, stop=BODY)
        loss0 = nn.CrossEntropyLoss()(net(protos, start=BODY), y)
        loss1 = 0
        if rnd > 0:
            protos_new = protos.clone().detach()
            for i in range(len(y)):
                yi = y[i].item()
                protos_new[i] = global_protos[yi].detach() if yi in global_protos else local_protos1[yi].detach()
            loss1 = nn.MSELoss()(protos_new, protos)
        (loss0 + lam * loss1).backward()
        opt.step()
    for param in net.parameters():
        param.requires_grad = True
    return weights(net), authors_local_protos(net, ctx)


def fedpac_context(cid: int, classes: list[int], n_train: int, round: int, model=None, **train):
    settings = {"batch_size": 10, "lr": 0.05, "momentum": 0.5, "weight_decay": 5e-4, "local_epochs": 2, **train}
    return client_context(
        cid, n_train=n_train, data_seed=100 + cid, classes=classes, model=model, round=round, seed=5, **settings
    )


def pflkit_client(ctx, model: dict, protos: torch.Tensor, seen: torch.Tensor, *overrides: str):
    alg = build("fedpac", ctx, *overrides)
    payload = {"global": model, PROTOS: protos, SEEN: seen}
    state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 9), 0), ctx)
    return alg.local_train(payload, state, ctx)


@pytest.mark.parametrize("overrides,lam", [((), 1.0), (("fedpac.lam=3.0",), 3.0)])
def test_fedpac_client_round_matches_the_authors_local_training(overrides, lam):
    ctx = fedpac_context(0, [0, 1, 2, 3, 4], 40, round=3)
    model = params_of(ctx, 2)
    g = torch.Generator().manual_seed(0)
    protos, seen = torch.rand(10, 64, generator=g), torch.tensor([c in (0, 2, 3, 7) for c in range(10)])
    new, upload, _ = pflkit_client(ctx, model, protos, seen, *overrides)  # classes 1 and 4: their own mean
    expected, expected_protos = authors_local_training(ctx, model, {c: protos[c] for c in (0, 2, 3, 7)}, 2, lam)
    assert_expected_close(new["model"], expected)
    assert_expected_close(upload["params"], expected)
    for c in range(10):
        want = expected_protos.get(c, torch.zeros(64))
        torch.testing.assert_close(upload["class_means"][c], want, rtol=1e-5, atol=1e-6)
    plain, _ = authors_local_training(ctx, model, {}, 0)
    assert moved(expected, plain)  # the alignment term matters here


def test_fedpac_round_one_trains_the_body_on_cross_entropy_alone():
    ctx = fedpac_context(1, [3, 4, 5], 30, round=1)
    model = params_of(ctx, 4)
    new, _, _ = pflkit_client(ctx, model, torch.rand(10, 64), torch.ones(10, dtype=torch.bool))
    expected, _ = authors_local_training(ctx, model, {}, 0)
    assert_expected_close(new["model"], expected)


def test_fedpac_statistics_match_the_authors_statistics_extraction():
    ctx = fedpac_context(2, [1, 5, 6, 8], 30, round=2)
    model = params_of(ctx, 3)
    v, h_ref = authors_statistics(module_at(ctx.model, model).eval(), ctx)
    moments = ctx.class_sums(model, feature_moments(BODY))
    counts = ctx.label_counts.to(moments.dtype)
    _, variance, rows = feature_statistics(moments, counts, ctx.num_train.to(moments.dtype))
    assert float(variance) == pytest.approx(v, rel=1e-5) and v > 0
    torch.testing.assert_close(rows, h_ref, rtol=1e-5, atol=1e-6)
    _, upload, _ = pflkit_client(ctx, model, torch.zeros(10, 64), torch.zeros(10, dtype=torch.bool))
    assert float(upload["variance"]) == pytest.approx(v, rel=1e-5)  # of the received model, before training
    torch.testing.assert_close(upload["class_rows"], h_ref, rtol=1e-5, atol=1e-6)


# ============================================================================ whole rounds
CLIENTS = [([0, 1, 2, 3], 30), ([2, 3, 4, 5], 40), ([0, 5, 6, 7, 8, 9], 20)]


def authors_rounds(contexts, init: dict, rounds: int):
    """train_round_fedpac with every client taking part: per client the statistics of its model,
    then local_training; the server's sample-weighted average of the models (their bodies go to
    every client), protos_aggregation (class-count-weighted means) and per client
    agg_classifier_weighted_p with get_head_agg_weight's weights (its matrices solved by
    ``simplex_qp``, weights <= 1e-3 zeroed). Returns each round's client models and prototypes."""
    models = [dict(init) for _ in contexts(1)]
    global_protos: dict = {}
    history = []
    for rnd in range(rounds):
        ctxs = contexts(rnd + 1)
        vars_, hs, local_weights, local_protos, sizes = [], [], [], [], []
        for ctx, model in zip(ctxs, models):
            v, h = authors_statistics(module_at(ctx.model, model).eval(), ctx)
            vars_.append(v)
            hs.append(h)
            w, protos = authors_local_training(ctx, model, global_protos, rnd)
            local_weights.append(w)
            local_protos.append(protos)
            sizes.append(torch.bincount(ctx.data.train_y, minlength=10).float())
        agg = torch.tensor([len(ctx.data.train_y) for ctx in ctxs], dtype=torch.float32)
        agg = agg / agg.sum()
        global_w = {k: sum(agg[i] * local_weights[i][k] for i in range(len(ctxs))) for k in init}
        labels: dict[int, list] = {}
        for protos, size in zip(local_protos, sizes):
            for label, proto in protos.items():
                labels.setdefault(label, []).append((size[label], proto))
        global_protos = {c: sum(n * p for n, p in pairs) / sum(n for n, _ in pairs) for c, pairs in labels.items()}
        new_models = []
        for p in authors_qp_matrices(vars_, hs):
            alpha = simplex_qp(p.astype(np.float64))
            assert alpha is not None
            alpha = [a * (a > 1e-3) for a in alpha]
            wc = sum(alpha)
            head = {k: sum(alpha[j] * local_weights[j][k] for j in range(len(ctxs))) / wc for k in HEAD}
            new_models.append({**{k: v for k, v in global_w.items() if k not in HEAD}, **head})
        models = new_models
        history.append(([dict(m) for m in models], dict(global_protos), global_w))
    return history


def test_fedpac_server_matches_the_authors_round():
    shared = build_model("digits_cnn", (1, 8, 8), 10)

    def contexts(t):
        return [fedpac_context(i, c, n, round=t, model=shared) for i, (c, n) in enumerate(CLIENTS)]

    init = params_of(contexts(1)[0], 1)
    alg = build("fedpac", contexts(1)[0])
    server = alg.prepare(alg.init_server(init), summaries([n for _, n in CLIENTS]))
    states = [alg.init_client(init, i) for i in range(len(CLIENTS))]
    for t, (models, protos, global_w) in enumerate(authors_rounds(contexts, init, 2), start=1):
        uploads = []
        for i, ctx in enumerate(contexts(t)):
            payload = alg.downlink(server, i, t)
            state, _ = alg.local_init(payload, states[i], ctx)
            states[i], upload, _ = alg.local_train(payload, state, ctx)
            uploads.append({**upload, "num_samples": int(upload["num_samples"]), "client_id": i})
        server = alg.aggregate(server, uploads, t)
        assert_expected_close(server["global"], global_w)
        for c in range(10):
            assert bool(server[SEEN][c]) == (c in protos)
            if c in protos:
                torch.testing.assert_close(server[PROTOS][c], protos[c], rtol=1e-5, atol=1e-6)
        for i, model in enumerate(models):
            received = alg.downlink(server, i, t + 1)["global"]
            for k in model:
                torch.testing.assert_close(received[k], model[k], rtol=1e-4, atol=1e-5, msg=f"client {i} {k}")
            assert set(server[HEADS][i]) == set(HEAD)
    # the heads differ per client: collaboration is personal
    assert moved(alg.downlink(server, 0, 3)["global"], alg.downlink(server, 2, 3)["global"])


def test_fedpac_without_collaboration_keeps_each_clients_trained_head():
    ctx = fedpac_context(0, [0, 1, 2], 30, round=1)
    init = params_of(ctx, 1)
    alg = build("fedpac", ctx, "fedpac.collaborate=false")
    server = alg.prepare(alg.init_server(init), summaries([30]))
    payload = alg.downlink(server, 0, 1)
    state, _ = alg.local_init(payload, alg.init_client(init, 0), ctx)
    new, upload, _ = alg.local_train(payload, state, ctx)
    server = alg.aggregate(server, [{**upload, "num_samples": 30, "client_id": 0}], 1)
    for k in HEAD:
        assert torch.equal(alg.downlink(server, 0, 2)["global"][k], new["model"][k])


def test_a_newcomer_receives_the_global_head():
    ctx = fedpac_context(0, [0, 1], 20, round=1)
    alg = build("fedpac", ctx)
    server = alg.prepare(alg.init_server(params_of(ctx, 1)), summaries([20]))
    server = {**server, "global": params_of(ctx, 6)}
    assert torch.equal(alg.downlink(server, 5, 2)["global"]["fc.weight"], server["global"]["fc.weight"])


@pytest.mark.integration
def test_fedpac_resumes_after_an_interruption_to_the_uninterrupted_numbers(tmp_path, fast_config):
    from pflkit.run.experiment import resume_experiment, run_experiment
    from tests.support.runs import InterruptAfter, records_without_timings

    config = load_config(None, fast_config + ['algorithms=["fedpac"]', "rounds=3"])
    run_experiment(config, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            config, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedpac", 2)]
        )
    resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    assert records_without_timings(tmp_path / "cut") == records_without_timings(tmp_path / "full")

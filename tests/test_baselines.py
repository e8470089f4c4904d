"""Update rules of FedAvg-C, FedProx-C, local, FedAMP, FedFomo and APPLE on tiny problems
(spec §2.3, 2.8, 2.10, 2.11), each recomputed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms import ClientSummary
from pflkit.algorithms.apple import loss_scale
from pflkit.config import ConfigError, load_config
from pflkit.engines import ClientJob, RoundSetup, run_client
from pflkit.engines.schedule import training_part
from pflkit.functional import NonFiniteLossError, evaluate, forward
from pflkit.methods import build_algorithm

from helpers import batch_pairs, params_of, sgd_reference, tiny_context


def build(name: str, ctx, *overrides: str):
    cfg = load_config(None, list(overrides))
    return build_algorithm(name, cfg.algorithm_sections(), ctx.train, ctx.units)


def sq(a, b) -> float:
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a))


def ce_grads(ctx, params, x, y):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = F.cross_entropy(forward(ctx.model, leaves, x), y)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def summaries(n: int, sizes=None):
    return [ClientSummary(i, (sizes or [10] * n)[i], torch.zeros(10).numpy()) for i in range(n)]


@pytest.mark.parametrize("name", ["fedavgc", "fedproxc"])
def test_finetuned_methods_evaluate_the_finetuned_global_and_train_from_it(name):
    ctx = tiny_context()
    glob = params_of(ctx, 2)
    alg = build(name, ctx, "fedproxc.mu=0.5")
    state, _ = alg.local_init({"global": glob}, alg.init_client(params_of(ctx, 1), 0), ctx)
    tuned = sgd_reference(ctx, glob, "finetune", 1)
    for k in glob:
        torch.testing.assert_close(alg.eval_params(state)[k], tuned[k])
    _, upload, _ = alg.local_train({"global": glob}, state, ctx)
    prox = {"prox_anchor": glob, "prox_mu": 0.5} if name == "fedproxc" else {}
    trained = sgd_reference(ctx, tuned, "train", 1, **prox)
    for k in glob:
        torch.testing.assert_close(upload["params"][k], trained[k])


def test_finetuning_options_two_epochs_converged_and_training_from_the_raw_global():
    ctx = tiny_context()
    glob = params_of(ctx, 2)
    alg = build("fedavgc", ctx, "fedavgc.ft_epochs=2", "fedavgc.upload_from=global")
    state, _ = alg.local_init({"global": glob}, alg.init_client(glob, 0), ctx)
    tuned = sgd_reference(ctx, glob, "finetune", 2)
    torch.testing.assert_close(state["model"], tuned)
    _, upload, _ = alg.local_train({"global": glob}, state, ctx)
    raw = sgd_reference(ctx, glob, "train", 1)
    torch.testing.assert_close(upload["params"], raw)
    conv = build("fedavgc", ctx, "fedavgc.ft_until_converged=true", "fedavgc.ft_max_epochs=4",
                 "fedavgc.ft_window=2", "fedavgc.ft_threshold=1e-9")
    _, info = conv.local_init({"global": glob}, conv.init_client(glob, 0), ctx)
    assert info["ft_epochs"] == 4  # never below 1e-9: stopped by the cap


def test_fedproxc_finetunes_with_the_proximal_term_only_when_asked():
    ctx = tiny_context()
    glob, local = params_of(ctx, 2), params_of(ctx, 1)
    alg = build("fedproxc+ala", ctx, "fedproxc.mu=2.0", "fedproxc.ft_prox=true")
    plain = build("fedproxc", ctx, "fedproxc.mu=2.0", "fedproxc.ft_prox=true")
    state, _ = plain.local_init({"global": glob}, plain.init_client(local, 0), ctx)
    expected = sgd_reference(ctx, glob, "finetune", 1, prox_anchor=glob, prox_mu=2.0)
    torch.testing.assert_close(state["model"], expected)
    assert alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)[0]["model"].keys() == glob.keys()


def test_local_training_never_communicates():
    ctx = tiny_context()
    init = params_of(ctx, 1)
    alg = build("local", ctx)
    server = alg.prepare(alg.init_server(init), summaries(1))
    assert alg.downlink(server, 0, 1) == {}
    state, _ = alg.local_init({}, alg.init_client(init, 0), ctx)
    torch.testing.assert_close(state["model"], init)
    new, upload, _ = alg.local_train({}, state, ctx)
    expected = sgd_reference(ctx, init, "train", 1)
    torch.testing.assert_close(new["model"], expected)
    assert upload["params"] == {} and alg.aggregate(server, [upload], 1) is server
    with pytest.raises(ValueError, match="ALA"):
        build("local+ala", ctx)


def test_fedamp_cloud_models_follow_the_attention_coefficients():
    ctx = tiny_context()
    base = params_of(ctx, 1)
    models = {0: base, 1: {k: v + 0.01 for k, v in base.items()}, 2: {k: v + 0.3 for k, v in base.items()}}
    alg = build("fedamp", ctx, "fedamp.alpha_k=0.01", "fedamp.sigma=1.0")
    server = {**alg.init_server(base), "models": models}
    xi = alg.coefficients(server, 0)
    expected = {j: 0.01 * math.exp(-sq(models[0], models[j]) / 1.0) / 1.0 for j in (1, 2)}
    assert xi[1] == pytest.approx(expected[1]) and xi[2] == pytest.approx(expected[2])
    assert xi[0] == pytest.approx(1 - expected[1] - expected[2])
    cloud = alg.downlink(server, 0, 1)["cloud"]
    for k in base:
        torch.testing.assert_close(cloud[k], sum(xi[j] * models[j][k] for j in models))
    # the paper's alpha_k = 1000 on nearly equal models: literal xi_ii < 0, the convex default caps it
    close = {**server, "models": {0: base, 1: {k: v + 1e-4 for k, v in base.items()}}}
    literal = build("fedamp", ctx, "fedamp.convex=false")
    assert literal.coefficients(close, 0)[0] < 0
    capped = build("fedamp", ctx).coefficients(close, 0)
    assert capped[0] == pytest.approx(0.0, abs=1e-12) and all(v >= 0 for v in capped.values())


def test_fedamp_keeps_its_model_and_trains_towards_the_cloud_model():
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.5)
    own, cloud = params_of(ctx, 1), params_of(ctx, 2)
    alg = build("fedamp", ctx, "fedamp.lam=100.0", "fedamp.alpha_k=10.0")
    state, _ = alg.local_init({"cloud": cloud}, {"model": own}, ctx)
    assert state["model"] is own
    new, upload, _ = alg.local_train({"cloud": cloud}, state, ctx)
    (x, y), = batch_pairs(ctx, "train", 1)
    g = ce_grads(ctx, own, x, y)
    for k in own:
        torch.testing.assert_close(new["model"][k], own[k] - 0.5 * (g[k] + 10.0 * (own[k] - cloud[k])),
                                   rtol=1e-5, atol=1e-6)
    norm = build("fedamp", ctx, "fedamp.lam=100.0", "fedamp.alpha_k=10.0", "fedamp.squared_prox=false")
    got = norm.local_train({"cloud": cloud}, state, ctx)[0]["model"]
    dist = math.sqrt(sq(own, cloud))
    for k in own:
        expected = own[k] - 0.5 * (g[k] + 10.0 / 2 * (own[k] - cloud[k]) / dist)
        torch.testing.assert_close(got[k], expected, rtol=1e-4, atol=1e-6)


def test_fedamp_aggregation_keeps_every_clients_latest_model():
    ctx = tiny_context()
    base = params_of(ctx, 1)
    alg = build("fedamp", ctx)
    server = alg.prepare(alg.init_server(base), summaries(3))
    new = params_of(ctx, 3)
    server = alg.aggregate(server, [{"params": new, "num_samples": 5, "client_id": 1}], 1)
    assert server["models"][1] is new
    torch.testing.assert_close(server["models"][0], base)


def test_fedamp_and_apple_refuse_partial_participation():
    for name in ["fedamp", "apple", "fedamp+ala"]:
        with pytest.raises(ConfigError, match="join_ratio must be 1"):
            load_config(None, [f'algorithms=["{name}"]', "join_ratio=0.5"])
    load_config(None, ['algorithms=["fedfomo"]', "join_ratio=0.5"])


def test_fedfomo_weights_models_by_validation_gain_per_distance():
    ctx = tiny_context(n_train=40)
    alg = build("fedfomo", ctx)
    old = {k: 6 * v for k, v in params_of(ctx, 1).items()}  # confident and wrong: a poor model
    received = [params_of(ctx, s) for s in (2, 3, 4)]
    received.append({k: v.clone() for k, v in old.items()})  # no gain, weight 0
    validation = ctx.holdout(0.2)
    val_x, val_y = validation.x, validation.y
    assert len(val_y) == 8 and torch.equal(val_x, ctx.data.train_x[-8:])
    loss = lambda p: evaluate(ctx.model, p, val_x, val_y)["loss_sum"] / 8  # noqa: E731
    w = [max(0.0, (loss(old) - loss(t)) / (math.sqrt(sq(t, old)) + 1e-5)) for t in received]
    assert all(wn > 0 for wn in w[:3]) and w[3] == 0
    payload = {"models": received, "ids": torch.tensor([1, 2, 3, 4])}
    state, _ = alg.local_init(payload, {"model": old}, ctx)
    torch.testing.assert_close(state["weights"], torch.tensor(w, dtype=torch.float64))
    for k in old:
        expected = old[k] + sum(wn / sum(w) * (t[k] - old[k]) for wn, t in zip(w, received))
        torch.testing.assert_close(state["model"][k], expected)
    new, upload, _ = alg.local_train(payload, state, ctx)
    assert training_part(ctx.data.num_train, 0.2) == 32
    server = alg.prepare(alg.init_server(old), summaries(5))
    server = alg.aggregate(server, [{**upload, "client_id": 0}], 1)
    assert server["affinity"][0, 1:].tolist() == pytest.approx(w)
    assert alg.downlink(server, 0, 2)["ids"].tolist()[0] == 1 + max(range(4), key=lambda m: w[m])


def test_fedfomo_keeps_its_model_when_no_received_model_helps():
    ctx = tiny_context()
    alg = build("fedfomo", ctx)
    old = params_of(ctx, 1)
    state, _ = alg.local_init({"models": [old], "ids": torch.tensor([1])}, {"model": old}, ctx)
    torch.testing.assert_close(state["model"], old)
    assert float(state["weights"].sum()) == 0


def test_fedfomo_top_m_selection_by_affinity():
    ctx = tiny_context()
    alg = build("fedfomo", ctx, "fedfomo.num_models=2")
    server = alg.prepare(alg.init_server(params_of(ctx, 1)), summaries(4))
    server["affinity"][0] = torch.tensor([9.0, 0.5, 3.0, 1.0], dtype=torch.float64)
    assert alg.downlink(server, 0, 1)["ids"].tolist() == [2, 3]


def test_apple_loss_schedule():
    assert loss_scale(0, 100, 0.2, "cos") == pytest.approx(1.0)
    assert loss_scale(10, 100, 0.2, "cos") == pytest.approx(0.5)
    assert loss_scale(20, 100, 0.2, "cos") == 0.0
    assert loss_scale(10, 100, 0.2, "exp") == pytest.approx(0.001 ** 0.5)


def test_apple_step_updates_own_core_and_relationship_vector():
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.05)
    alg = build("apple", ctx, "apple.mu=0.5", "apple.L=1.0")
    cores = [params_of(ctx, s) for s in (1, 2, 3)]
    server = alg.prepare(alg.init_server(cores[0]), summaries(3, [10, 30, 60]))
    server["models"] = dict(enumerate(cores))
    payload = alg.downlink(server, 0, 1)
    torch.testing.assert_close(payload["p0"], torch.tensor([0.1, 0.3, 0.6]))
    state, _ = alg.local_init(payload, alg.init_client(cores[0], 0), ctx)
    p = torch.tensor([0.1, 0.3, 0.6])
    personal = {k: sum(p[j] * cores[j][k] for j in range(3)) for k in cores[0]}
    torch.testing.assert_close(alg.eval_params(state), personal)
    # perturb p away from p0 so the proximal term has a gradient
    state = {**state, "p": torch.tensor([0.2, 0.3, 0.5])}
    p = state["p"]
    personal = {k: sum(p[j] * cores[j][k] for j in range(3)) for k in cores[0]}
    new, upload, _ = alg.local_train(payload, state, ctx)
    (x, y), = batch_pairs(ctx, "train", 1)
    g = ce_grads(ctx, personal, x, y)
    scale = loss_scale(1, ctx.train.rounds, 1.0, "cos") * 0.5
    core_lr = 0.05  # the local lr (default)
    for k in cores[0]:
        torch.testing.assert_close(new["model"][k], cores[0][k] - core_lr * p[0] * g[k], rtol=1e-4, atol=1e-6)
    grad_p = torch.tensor([float(sum((g[k] * cores[j][k]).sum() for k in g)) for j in range(3)])
    grad_p += 2 * scale * (p - payload["p0"])
    torch.testing.assert_close(new["p"], p - 0.01 * grad_p, rtol=1e-4, atol=1e-6)
    assert upload["params"] is new["model"] or torch.equal(upload["params"]["fc.bias"], new["model"]["fc.bias"])


ROUND_METHODS = ["local", "fedavgc", "fedproxc", "fedamp", "fedfomo", "apple", "fedavgc+ala", "fedproxc+ala",
                 "fedamp+ala"]


@pytest.mark.parametrize("name", ROUND_METHODS)
def test_two_rounds_through_run_client_change_what_each_method_trains(name):
    from pflkit.data.federated import FederatedData
    ctx = tiny_context(n_train=30)
    other = tiny_context(n_train=20, seed=1)
    other.data.client_id = 1
    data = FederatedData.from_clients([ctx.data, other.data], num_classes=10)
    alg = build(name, ctx, "fedala.max_start_epochs=3")
    init = params_of(ctx, 1)
    setup = RoundSetup(alg, data, ctx.model, ctx.units, ctx.train, seed=0)
    server = alg.prepare(alg.init_server(init), [ClientSummary(i, c.num_train, data.train_label_counts(i))
                                                for i, c in enumerate(data.clients)])
    states = {i: alg.init_client(init, i) for i in range(2)}
    for t in (1, 2):
        results = [run_client(setup, ClientJob(i, alg.downlink(server, i, t), states[i], True), t) for i in range(2)]
        for r in results:
            states[r.client_id] = r.state
            assert r.evaluation["num_samples"] == data.client(r.client_id).num_test
        server = alg.aggregate(server, [{**r.upload, "client_id": r.client_id} for r in results], t)
    assert sq(alg.eval_params(states[0]), init) > 0


def test_nan_loss_names_the_method_and_stage():
    ctx = tiny_context()
    ctx.data.train_x[0] = float("nan")
    ctx.algorithm = "apple"
    alg = build("apple", ctx)
    init = params_of(ctx, 1)
    server = alg.prepare(alg.init_server(init), summaries(1))
    payload = alg.downlink(server, 0, 1)
    state, _ = alg.local_init(payload, alg.init_client(init, 0), ctx)
    with pytest.raises(NonFiniteLossError, match="apple, client 0, round 1, local training"):
        alg.local_train(payload, state, ctx)
    ctx.algorithm = "fedavgc"
    with pytest.raises(NonFiniteLossError, match="fine-tuning"):
        build("fedavgc", ctx).local_init({"global": init}, {"model": init}, ctx)


@pytest.mark.parametrize("bn_buffers", ["local", "global"])
def test_batch_norm_statistics_stay_local_unless_asked_and_the_server_averages_them(bn_buffers):
    from pflkit.algorithms import TrainSettings
    from pflkit.models import buffer_names, build_model

    model = build_model("resnet18", (3, 32, 32), 10)
    params = {k: v.detach() for k, v in model.named_parameters()}
    params.update({k: b.detach() for k, b in model.named_buffers() if k in buffer_names(model)})
    train = TrainSettings(bn_buffers=bn_buffers)
    for name in ["fedavg", "fedrep", "fedala"]:
        alg = build_algorithm(name, load_config(None, []).algorithm_sections(), train, model.units())
        server = alg.init_server(params)
        sent = set(alg.downlink(server, 0, 1)["global"])
        assert bool(set(buffer_names(model)) & sent) == (bn_buffers == "global"), name
    alg = build_algorithm("fedavg", load_config(None, []).algorithm_sections(), train, model.units())
    key = "bn1.running_mean"
    a = {**params, key: torch.ones(64)}
    b = {**params, key: torch.zeros(64)}
    merged = alg.aggregate(alg.init_server(params), [{"params": a, "num_samples": 1, "client_id": 0},
                                                     {"params": b, "num_samples": 3, "client_id": 1}], 1)
    torch.testing.assert_close(merged["global"][key], torch.full((64,), 0.25))

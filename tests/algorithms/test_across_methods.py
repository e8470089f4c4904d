"""What every method shares: two rounds through run_client change what each method trains and
score its evaluated model (``eval_params``: docs/explanations/metrics.md), NaN losses name the
method and the stage, batch-norm statistics stay local unless asked, and the methods that need every
client refuse partial participation. Each method's own update rules are in
tests/methods/test_<method>.py."""

from __future__ import annotations

import pytest
import torch

from pflkit.algorithms import ClientSummary
from pflkit.config import ConfigError, load_config
from pflkit.data.federated import ClientData, FederatedData
from pflkit.engines import ClientJob, RoundSetup, run_client
from pflkit.functional import NonFiniteLossError, evaluate
from pflkit.methods import build_algorithm
from pflkit.models import build_model
from tests.support.builders import build, params_of, summaries, tiny_context
from tests.support.checks import assert_params_close, differs
from tests.support.references import sq


def test_fedamp_and_apple_refuse_partial_participation():
    for name in ["fedamp", "apple", "fedamp+ala"]:
        with pytest.raises(ConfigError, match="join_ratio must be 1"):
            load_config(None, [f'algorithms=["{name}"]', "join_ratio=0.5"])
    load_config(None, ['algorithms=["fedfomo"]', "join_ratio=0.5"])


# ---------------------------------------------------------------- rounds through run_client


ROUND_METHODS = [
    "local",
    "fedavgc",
    "fedproxc",
    "fedamp",
    "fedfomo",
    "apple",
    "fedavgc+ala",
    "fedproxc+ala",
    "fedamp+ala",
]


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
    server = alg.prepare(
        alg.init_server(init),
        [ClientSummary(i, c.num_train, data.train_label_counts(i)) for i, c in enumerate(data.clients)],
    )
    states = {i: alg.init_client(init, i) for i in range(2)}
    for t in (1, 2):
        results = [run_client(setup, ClientJob(i, alg.downlink(server, i, t), states[i], True), t) for i in range(2)]
        for r in results:
            states[r.client_id] = r.state
            assert r.evaluation["num_samples"] == data.client(r.client_id).num_test
        server = alg.aggregate(server, [{**r.upload, "client_id": r.client_id} for r in results], t)
    assert sq(alg.eval_params(states[0]), init) > 0


METHODS = ["perfedavg", "pfedme", "fedphp", "partialfed"]


def two_clients() -> FederatedData:
    g = torch.Generator().manual_seed(5)
    means = torch.randn(10, 1, 8, 8, generator=g)
    clients = []
    for i, n in enumerate((20, 14)):
        y = torch.randint(0, 10, (n + 6,), generator=g)
        x = means[y] + 0.5 * torch.randn(n + 6, 1, 8, 8, generator=g)
        clients.append(ClientData(i, x[:n], y[:n], x[n:], y[n:]))
    return FederatedData.from_clients(clients, 10, "toy")


EVAL_KEY = {"perfedavg": "eval", "pfedme": "personal", "fedphp": "trained", "partialfed": "model"}


@pytest.mark.parametrize("name", METHODS + [f"{m}+ala" for m in METHODS])
def test_two_rounds_through_run_client(name):
    base = name.split("+")[0]
    data = two_clients()
    torch.manual_seed(0)
    model = build_model("digits_cnn", (1, 8, 8), 10)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = load_config(None, ["fedala.max_start_epochs=3", "rounds=2", "lr=0.05", "pfedme.inner_steps=2"])
    train = cfg.train
    alg = build_algorithm(name, cfg.algorithm_sections(), train, model.units())
    setup = RoundSetup(alg, data, model, model.units(), train, seed=3)
    server = alg.init_server(init)
    states = {i: alg.init_client(init, i) for i in range(2)}
    for t in (1, 2):
        results = []
        for i in range(2):
            job = ClientJob(i, alg.downlink(server, i, t), states[i], evaluate=True)
            res = run_client(setup, job, t)
            # the evaluated model is the method's eval_params after local_init (docs/explanations/metrics.md)
            ctx_state, _ = alg.local_init(job.payload, states[i], _ctx(setup, i, t))
            expected = evaluate(model, ctx_state[EVAL_KEY[base]], data.client(i).test_x, data.client(i).test_y)
            assert res.evaluation == expected
            assert res.upload["num_samples"] == data.client(i).num_train
            assert_params_close(res.upload["params"], res.state["model"], rtol=0, atol=0)
            assert all(torch.isfinite(v).all() for v in res.upload["params"].values())
            if name.endswith("+ala"):
                assert (res.metrics["ala_epochs"] > 0) == (t == 2)  # ALA is idle while global == local
            states[i] = res.state
            results.append(res)
        old = server["global"]
        server = alg.aggregate(server, [{**r.upload, "client_id": r.client_id} for r in results], t)
        assert differs(server["global"], old)
    if base == "fedphp":  # mu_t = mu * t / T with T = config rounds
        assert results[0].metrics["hpm_mu"] == pytest.approx(0.9)


def _ctx(setup, i, t):
    return setup.context(i, t)


# ---------------------------------------------------------------- NaN losses


def test_nan_loss_names_the_method_and_stage():
    ctx = tiny_context()
    ctx.data.train_x[0] = float("nan")
    ctx.algorithm = "apple"
    alg = build("apple", ctx)
    init = params_of(ctx, 1)
    server = alg.prepare(alg.init_server(init), summaries([10] * 1))
    payload = alg.downlink(server, 0, 1)
    state, _ = alg.local_init(payload, alg.init_client(init, 0), ctx)
    with pytest.raises(NonFiniteLossError, match="apple, client 0, round 1, local training"):
        alg.local_train(payload, state, ctx)
    ctx.algorithm = "fedavgc"
    with pytest.raises(NonFiniteLossError, match="fine-tuning"):
        build("fedavgc", ctx).local_init({"global": init}, {"model": init}, ctx)


@pytest.mark.parametrize(
    "name,overrides,stage",
    [
        ("perfedavg", [], "local training"),
        ("perfedavg", ["perfedavg.hessian_free=true"], "local training"),
        ("pfedme", [], "personalised inner steps"),
        ("fedphp", [], "knowledge transfer"),
        ("fedphp", ["fedphp.kt='kd'"], "knowledge transfer"),
        ("partialfed", [], "model batches"),
        ("partialfed", ["partialfed.model_batches=0"], "strategy training"),
    ],
)
def test_nan_loss_raises_naming_the_stage(name, overrides, stage):
    ctx = tiny_context(n_train=10)
    ctx.data.train_x[3] = float("nan")
    alg = build(name, ctx, *overrides)
    glob = params_of(ctx, 2)
    with pytest.raises(NonFiniteLossError, match=stage):
        alg.local_train({"global": glob}, alg.init_client(glob, 0), ctx)


# ---------------------------------------------------------------- batch-norm statistics


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
    merged = alg.aggregate(
        alg.init_server(params),
        [{"params": a, "num_samples": 1, "client_id": 0}, {"params": b, "num_samples": 3, "client_id": 1}],
        1,
    )
    torch.testing.assert_close(merged["global"][key], torch.full((64,), 0.25))

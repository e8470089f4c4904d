"""SosicFL: the simplex parametrisation, the preparation stage (LDA, clustering, subregions and
their sampler), runs of the three variants, and the client round against my transcription of
floco (dennis-grinwald/floco a25b3a1, ``src/server/floco.py``: SimplexModel, SimplexLinear;
``src/client/floco.py``: training_loop; ``src/server/fedavg.py``: aggregate; the transcription is
in tests/support/references.py, shared with test_sosicfl_plus.py). The k-Fold and label-Dirichlet
partitions are in tests/data/test_partition_kfold.py, the SosicFL models in tests/models/."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch.nn import functional as F

from pflkit.algorithms.simplex import (
    SimplexError,
    cluster,
    distances,
    lda_points,
    make_endpoints,
    mean_distance_to_simplex,
    prepare_simplex,
    realise,
    sample_region,
)
from pflkit.algorithms.sosicfl import ALPHAS, STEP, simplex_loss
from pflkit.config import ConfigError, load_config
from pflkit.methods import build_algorithm
from pflkit.run.experiment import run_experiment
from tests.support.builders import batch_pairs, params_of, sosicfl_setup, tiny_context
from tests.support.checks import ATOL, RTOL, assert_expected_close
from tests.support.references import BODY, FlocoModel, floco_optimizer, floco_training_loop


def test_lda_points_of_identical_label_distributions_coincide() -> None:
    counts = np.array([[80, 80, 20, 20, 0, 0]] * 4 + [[0, 0, 20, 20, 80, 80]] * 3 + [[10, 50, 0, 30, 30, 0]])
    points = lda_points(counts, 3, seed=0)
    assert points.shape == (8, 3)
    assert np.allclose(points.sum(1), 1)
    assert np.allclose(points[:4], points[0], atol=1e-9) and np.allclose(points[4:7], points[4], atol=1e-9)
    assert np.abs(points[0] - points[4]).sum() > 0.1


def test_lda_needs_fewer_endpoints_than_labels() -> None:
    with pytest.raises(SimplexError, match=r"num_endpoints=4 .* 4 labels"):
        lda_points(np.ones((5, 4)), 4, seed=0)


def test_hilbert_distance_by_hand_and_at_the_boundary() -> None:
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.3, 0.5])
    # log(max_i p_i/q_i / min_j p_j/q_j) = log(2.5 / 0.4)
    assert distances(p, q, "hilbert", eps=0)[0, 0] == pytest.approx(math.log(6.25))
    assert distances(p, p, "hilbert")[0, 0] == pytest.approx(0, abs=1e-12)
    assert distances(p, q, "l1")[0, 0] == pytest.approx(0.6)
    corner = np.array([1.0, 0.0, 0.0])
    with np.errstate(divide="ignore"):
        assert np.isinf(distances(corner, p, "hilbert", eps=0)[0, 0])  # the metric is infinite at the boundary
    smoothed = distances(corner, p, "hilbert")[0, 0]  # eps = 1e-6: finite but very far
    assert math.isfinite(smoothed) and smoothed > math.log(1e5)


@pytest.mark.parametrize(
    "metric,algo", [("l1", "kmeans"), ("hilbert", "kmeans"), ("l1", "kcenter"), ("hilbert", "kcenter")]
)
def test_clustering_recovers_planted_groups(metric: str, algo: str) -> None:
    rng = np.random.default_rng(0)
    centres = np.array([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]])
    truth = np.repeat(np.arange(3), 20)
    points = np.array([rng.dirichlet(200 * centres[c]) for c in truth])
    found = cluster(points, 3, metric, algo, n_init=5, seed=1)
    # the same partition up to a renaming of the clusters
    pairs = {(int(t), int(f)) for t, f in zip(truth, found.assignment)}
    assert len(pairs) == 3 and len({f for _, f in pairs}) == 3
    for c in range(3):
        assert np.abs(found.centers[found.assignment[truth == c][0]] - centres[c]).sum() < 0.1


def test_fewer_distinct_points_than_clusters_warns_and_reduces(caplog: pytest.LogCaptureFixture) -> None:
    points = np.array([[0.6, 0.2, 0.2]] * 5 + [[0.2, 0.2, 0.6]] * 5)
    with caplog.at_level(logging.WARNING):
        found = cluster(points, 4, seed=0)
    assert len(found.centers) == 2 and "only 2 distinct" in caplog.text


@pytest.mark.parametrize("center", [[1 / 3, 1 / 3, 1 / 3], [0.7, 0.2, 0.1], [0.05, 0.05, 0.9]])
def test_sampler_points_lie_in_the_subregion_and_are_uniform(center: list[float]) -> None:
    mu, eta = np.array(center), 0.5
    points = sample_region(mu, eta, 20_000, np.random.default_rng(0))
    assert points.shape == (20_000, 3)
    assert np.all(points >= -1e-12) and np.allclose(points.sum(1), 1)
    assert np.all(np.abs(points - mu).sum(1) <= eta + 1e-12)
    # reference: uniform simplex points that fall in the region are uniform on it
    ref = np.random.default_rng(1).dirichlet(np.ones(3), size=400_000)
    ref = ref[np.abs(ref - mu).sum(1) <= eta][:20_000]
    for stat in (lambda a: a[:, 0], lambda a: a[:, 1], lambda a: np.abs(a - mu).sum(1)):
        assert stats.ks_2samp(stat(points), stat(ref)).pvalue > 0.01


def test_sampler_refuses_a_non_positive_radius() -> None:
    with pytest.raises(SimplexError, match="rho > 0"):
        sample_region(np.array([0.5, 0.5]), 0.0, 10, np.random.default_rng(0))
    with pytest.raises(SimplexError, match="sosicfl.rho must be > 0"):
        prepare_simplex(
            np.ones((4, 5)),
            num_endpoints=3,
            num_clusters=2,
            rho=0.0,
            metric="l1",
            algo="kmeans",
            n_init=1,
            pool_size=10,
            seed=0,
        )


def test_mean_distance_to_the_simplex_by_monte_carlo() -> None:
    # centroid of the 1-simplex: E|1/2 - u| * 2 = 1/2 for u ~ U(0, 1)
    assert mean_distance_to_simplex(np.array([[0.5, 0.5]]), seed=0) == pytest.approx(0.5, abs=0.01)


def test_endpoint_gradient_is_alpha_times_the_realised_gradient() -> None:
    ctx = tiny_context()
    base = params_of(ctx, 0)
    head = ["fc.weight", "fc.bias"]
    endpoints = make_endpoints(base, head, 3)
    assert all(f"fc.weight@{m}" in endpoints for m in range(3)) and "fc.weight" not in endpoints
    assert not torch.equal(endpoints["fc.weight@1"], endpoints["fc.weight@2"])  # independent initialisations
    alpha = torch.tensor([0.2, 0.5, 0.3])
    x, y = ctx.data.train_x[:10], ctx.data.train_y[:10]
    leaves = {k: v.clone().requires_grad_(True) for k, v in endpoints.items()}
    realised = realise(leaves, head, 3, alpha)
    loss = torch.nn.functional.cross_entropy(ctx.net(realised, x), y)
    grads = torch.autograd.grad(loss, [leaves[f"fc.weight@{m}"] for m in range(3)])
    plain = {k: v.detach().clone().requires_grad_(True) for k, v in realise(endpoints, head, 3, alpha).items()}
    g_plain = torch.autograd.grad(torch.nn.functional.cross_entropy(ctx.net(plain, x), y), plain["fc.weight"])[0]
    for m in range(3):
        assert torch.allclose(grads[m], alpha[m] * g_plain, atol=1e-6)


def test_simplex_loss_cycles_over_the_client_draws() -> None:
    ctx = tiny_context()
    params = make_endpoints(params_of(ctx, 0), ["fc.weight", "fc.bias"], 2)
    alphas = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    loss = simplex_loss(["fc.weight", "fc.bias"], 2)
    x, y = ctx.data.train_x[:10], ctx.data.train_y[:10]
    from pflkit.functional.training import Batch

    for step, m in [(0, 0), (1, 1), (2, 0)]:
        value, carried = loss(ctx.net, {**params, ALPHAS: alphas, STEP: torch.tensor(float(step))}, Batch(x, y), None)
        corner = {
            **{k: v for k, v in params.items() if "@" not in k},
            "fc.weight": params[f"fc.weight@{m}"],
            "fc.bias": params[f"fc.bias@{m}"],
        }
        assert value == pytest.approx(float(torch.nn.functional.cross_entropy(ctx.net(corner, x), y)), rel=1e-6)
        assert float(carried[STEP]) == step + 1


def _config(tmp_path, *overrides: str):
    return load_config(
        None,
        [
            "dataset=digits",
            "num_clients=12",
            "rounds=2",
            "batch_size=20",
            "sosicfl.num_clusters=3",
            "sosicfl.pool_size=500",
            "sosicfl.n_init=2",
            *overrides,
        ],
    )


@pytest.mark.integration
def test_sosicfl_runs_prepare_clusters_and_record_the_total_variance(tmp_path) -> None:
    config = _config(
        tmp_path,
        'algorithms=["sosicfl", "sosicfl_all", "sosicfl_plus", "fedavg"]',
        "test_set=official",
        "join_ratio=0.5",
        "eval_all_clients=true",
        "partition=kfold",
        "num_folds=3",
    )
    summary = run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for name in ("sosicfl", "sosicfl_all", "sosicfl_plus", "fedavg"):
        evaluated = [r for r in records if r["algorithm"] == name and "accuracy" in r]
        assert all(r["evaluated_clients"] == 12 for r in evaluated)  # everyone, with 6 participants
        trained = [r for r in records if r["algorithm"] == name and "update_variance" in r]
        assert len(trained) == 2 and all(r["update_variance"] > 0 for r in trained)
        assert "best_global_accuracy" in summary[name] and "best_local_accuracy" in summary[name]
        # Fig. 6 summarised: the mean total variance over the rounds
        assert summary[name]["mean_update_variance"] == pytest.approx(np.mean([r["update_variance"] for r in trained]))
    assert (tmp_path / "run" / "plots" / "total_variance.png").stat().st_size > 10_000  # Fig. 6 plotted
    plus = [r for r in records if r["algorithm"] == "sosicfl_plus" and "personal_loss" in r]
    assert plus


def test_sosicfl_server_state_is_the_preparation_and_literal_weights_shrink_the_step() -> None:
    ctx = tiny_context()
    units = ctx.units
    config = load_config(None, ["sosicfl.num_clusters=2", "sosicfl.pool_size=100", "sosicfl.n_init=1"])
    alg = build_algorithm("sosicfl", config.algorithm_sections(), ctx.train, units)
    from pflkit.algorithms import ClientSummary

    counts = [np.array([30, 30, 5, 5, 0, 0, 0, 0, 0, 0])] * 3 + [np.array([0, 0, 0, 0, 0, 0, 5, 5, 30, 30])] * 3
    clients = [ClientSummary(i, int(c.sum()), c) for i, c in enumerate(counts)]
    server = alg.prepare(alg.init_server(params_of(ctx, 0)), clients, seed=0)
    simplex = server["simplex"]
    assignment = simplex["assignment"].tolist()
    assert len(set(assignment[:3])) == 1 and len(set(assignment[3:])) == 1 and assignment[0] != assignment[3]
    payload = alg.downlink(server, 0, 1)
    # a fresh draw for each local step (the paper's §3.2): as many as the longest client's steps
    assert payload["alphas"].shape == (simplex["max_steps"], 3) and simplex["max_steps"] == 7  # 70 samples / 10
    assert len({tuple(a.tolist()) for a in payload["alphas"]}) > 1  # drawn (with replacement) from the pool
    assert (torch.abs(payload["alphas"] - payload["center"]).sum(1) <= simplex["eta"] + 1e-6).all()
    per_round = build_algorithm(
        "sosicfl",
        load_config(
            None,
            [
                "sosicfl.num_clusters=2",
                "sosicfl.pool_size=100",
                "sosicfl.n_init=1",
                "sosicfl.alpha_resample='per_round'",
            ],
        ).algorithm_sections(),
        ctx.train,
        units,
    )
    assert per_round.downlink(server, 0, 1)["alphas"].shape == (1, 3)  # Omega_tr = 1: one alpha per round
    late = build_algorithm(
        "sosicfl",
        load_config(None, ["sosicfl.late_start=0", "sosicfl.pool_size=100"]).algorithm_sections(),
        ctx.train,
        units,
    )
    assert torch.allclose(late.downlink(server, 0, 5)["center"], torch.full((3,), 1 / 3))  # t~ = infinity
    moved = {k: v + 1.0 for k, v in server["global"].items()}
    literal = build_algorithm(
        "sosicfl", load_config(None, ["sosicfl.server_weights=literal"]).algorithm_sections(), ctx.train, units
    )
    upload = [{"params": moved, "num_samples": 70, "client_id": 0}]
    new = literal.aggregate(server, upload, 1)["global"]
    assert torch.allclose(new["fc.weight@0"], server["global"]["fc.weight@0"] + 70 / 420)  # N over all clients
    assert torch.allclose(alg.aggregate(server, upload, 1)["global"]["fc.weight@0"], moved["fc.weight@0"])


def test_bad_sosicfl_settings_are_named() -> None:
    with pytest.raises(ConfigError, match="sosicfl.rho"):
        load_config(None, ["sosicfl.rho=0"])
    with pytest.raises(ConfigError, match="sosicfl.num_endpoints"):
        load_config(None, ["sosicfl.num_endpoints=1"])


def test_sosicfl_scores_the_subregion_ensemble_with_eval_samples() -> None:
    ctx = tiny_context()
    config = load_config(None, ["sosicfl.num_clusters=2", "sosicfl.pool_size=100", "sosicfl.eval_samples=4"])
    alg = build_algorithm("sosicfl", config.algorithm_sections(), ctx.train, ctx.units)
    from pflkit.algorithms import ClientSummary
    from pflkit.functional import Ensemble

    counts = [np.array([30, 30, 5, 5, 0, 0, 0, 0, 0, 0])] * 2 + [np.array([0, 0, 0, 0, 0, 0, 5, 5, 30, 30])] * 2
    server = alg.prepare(alg.init_server(params_of(ctx, 0)), [ClientSummary(i, 70, c) for i, c in enumerate(counts)])
    state, _ = alg.local_init(alg.downlink(server, 0, 1), alg.init_client(params_of(ctx, 0), 0), ctx)
    members = alg.eval_params(state)
    assert isinstance(members, Ensemble) and len(members) == 4
    first = state["eval_alphas"][0]
    expected = sum(first[m] * server["global"][f"fc.weight@{m}"] for m in range(3))
    assert torch.allclose(members[0]["fc.weight"], expected)


def test_clients_receive_the_servers_endpoints_and_upload_trained_ones() -> None:
    ctx = tiny_context()
    config = load_config(None, ["sosicfl.num_clusters=2", "sosicfl.pool_size=100"])
    alg = build_algorithm("sosicfl", config.algorithm_sections(), ctx.train, ctx.units)
    from pflkit.algorithms import ClientSummary

    counts = [np.array([30, 30, 5, 5, 0, 0, 0, 0, 0, 0])] * 2 + [np.array([0, 0, 0, 0, 0, 0, 5, 5, 30, 30])] * 2
    server = alg.prepare(alg.init_server(params_of(ctx, 0)), [ClientSummary(i, 70, c) for i, c in enumerate(counts)])
    server = {**server, "global": {k: v + 0.5 for k, v in server["global"].items()}}  # a later round's model
    payload = alg.downlink(server, 0, 3)
    assert set(payload["global"]) == set(alg.trainable)  # every endpoint travels, not just the shared layers
    stale = alg.init_client(params_of(ctx, 0), 0)
    state, _ = alg.local_init(payload, stale, ctx)
    assert all(torch.equal(state["model"][k], server["global"][k]) for k in alg.trainable)
    _, upload, _ = alg.local_train(payload, state, ctx)
    assert set(upload["params"]) == set(alg.trainable)
    assert not torch.equal(upload["params"]["fc.weight@0"], server["global"]["fc.weight@0"])


def test_clusters_that_share_a_centre_are_named_in_a_warning(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    """5-Fold with 3 endpoints: LDA puts 5 groups on 3 corners and clusters share centres (measured on
    MNIST: benchmarks/sosicfl_centres.py); prepare_simplex says so and names the way out."""
    from pflkit.algorithms import simplex

    centres = np.array([[1.0, 0, 0], [0, 1.0, 0], [1.0, 0, 0], [0.2, 0.3, 0.5]])
    assert simplex.coincident_centres(centres) == [(0, 2)]
    assert simplex.coincident_centres(centres + np.array([[0], [0], [0.01], [0]])) == []
    real = simplex.cluster

    def collapsed(*args, **kwargs):  # two pairs of clusters at one centre each, as LDA left them
        found = real(*args, **kwargs)
        return dataclasses.replace(found, centers=centres[[0, 0, 1, 1]])

    monkeypatch.setattr(simplex, "cluster", collapsed)
    counts = np.array([[30, 1, 1, 1], [1, 30, 1, 1], [1, 1, 30, 1], [1, 1, 1, 30]] * 3, dtype=float)
    with caplog.at_level(logging.WARNING):
        simplex.prepare_simplex(
            counts, num_endpoints=3, num_clusters=4, rho=0.4, metric="l1", algo="kmeans", n_init=2, pool_size=10, seed=0
        )
    messages = [r.getMessage() for r in caplog.records if "share one centre" in r.getMessage()]
    assert messages and "raise sosicfl.num_endpoints" in messages[0] and "M + 1 = 3" in messages[0]


@pytest.mark.integration
def test_simplex_pictures_draw_figure_5_with_the_global_panel_and_each_clients_lda_point(tmp_path, monkeypatch):
    from pflkit.federation import build_partitions, initial_params
    from pflkit.federation.checkpoint import load_checkpoint
    from pflkit.functional import evaluate
    from pflkit.run import simplex_report

    config = _config(tmp_path, 'algorithms=["sosicfl"]', "test_set=official", "partition=kfold", "num_folds=3")
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    drawn = {}
    real = simplex_report.plot_simplex_landscape
    monkeypatch.setattr(
        simplex_report, "plot_simplex_landscape", lambda *a, **k: drawn.update(args=a, kwargs=k) or real(*a, **k)
    )
    pictures = simplex_report.simplex_pictures(tmp_path / "run", clients=[0, 5], points=50)
    assert [p.name for p in pictures] == ["simplex-sosicfl.png", "landscape-sosicfl.png"]
    alphas, accuracy, centers = drawn["args"][:3]
    assert list(accuracy)[0] == "global model" and len(accuracy) == 3 and alphas.shape == (50, 3)
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "sosicfl-seed0.pt")
    simplex = state.server["simplex"]
    clients = [label for label in accuracy if label.startswith("client")]
    assert clients == [f"client {c} (cluster {int(simplex['assignment'][c])})" for c in (0, 5)]
    np.testing.assert_allclose(drawn["kwargs"]["points"][clients[1]], simplex["points"][5].numpy())  # the dot
    np.testing.assert_allclose(centers["global model"], np.full(3, 1 / 3), rtol=1e-6)  # the centroid's x
    # the global panel's accuracy at the centroid is the global model's accuracy on the official test set
    _, partitions = build_partitions(config, torch.device("cpu"))
    data = next(iter(partitions.values()))
    model = initial_params(config, data, 0, torch.device("cpu"))[0]
    alg = build_algorithm("sosicfl", config.algorithm_sections(), config.train, model.units())
    at_centroid = simplex_report.landscape(model, alg, state.server["global"], alg.centroid[None], *data.global_test)
    expected = evaluate(model, alg.global_params(state.server), *data.global_test)
    assert float(at_centroid[0]) == pytest.approx(expected["correct"] / expected["num_samples"], abs=1e-6)
    # the shared loader (also benchmarks/simplex_points.py) names what is missing
    loaded = simplex_report.load_simplex_run(tmp_path / "run")
    assert loaded.seed == 0 and loaded.state.rounds_done == state.rounds_done and loaded.alg.M1 == alg.M1
    with pytest.raises(ValueError, match="has no 'fedavg' run; it ran sosicfl"):
        simplex_report.load_simplex_run(tmp_path / "run", "fedavg")
    with pytest.raises(ValueError, match="no checkpoint of sosicfl seed 7"):
        simplex_report.load_simplex_run(tmp_path / "run", seed=7)


def test_every_weight_endpoint_is_an_independent_xavier_normal_draw_as_in_floco() -> None:
    """FLOCO (dennis-grinwald/floco a25b3a1) initialises every endpoint the same way; pflkit's
    endpoint 0 used to be the model's own (differently scaled) initial tensor."""
    torch.manual_seed(0)
    base = {"fc.weight": torch.nn.Linear(256, 40).weight.detach(), "fc.bias": torch.zeros(40)}
    endpoints = make_endpoints(base, ["fc.weight"], 3)
    xavier = (2 / (256 + 40)) ** 0.5
    draws = [endpoints[f"fc.weight@{m}"] for m in range(3)]
    assert all(abs(float(d.std()) / xavier - 1) < 0.05 for d in draws)
    assert not torch.equal(draws[0], base["fc.weight"])
    assert all(not torch.equal(draws[i], draws[j]) for i in range(3) for j in range(i + 1, 3))
    assert torch.equal(endpoints["fc.bias"], base["fc.bias"])  # one shared bias
    again = make_endpoints(base, ["fc.weight"], 3)  # keyed by the initial tensor: the same on every node
    assert all(torch.equal(again[f"fc.weight@{m}"], draws[m]) for m in range(3))


# ============================================================================ against floco


def test_sosicfl_matches_flocos_simplex_linear_per_step_alphas_and_endpoint_average():
    ctxs, alg, server = sosicfl_setup("sosicfl", epochs=2)
    M1 = alg.M1
    uploads, trained = [], []
    for ctx in ctxs:
        payload = alg.downlink(server, ctx.client_id, 1)
        alphas = payload["alphas"]
        # one draw per local step, from the client's subregion (an L1 ball around its centre, inside the simplex)
        assert len({tuple(a.tolist()) for a in alphas}) > 1
        assert (torch.abs(alphas - payload["center"]).sum(1) <= server["simplex"]["eta"] + 1e-5).all()
        torch.testing.assert_close(alphas.sum(1), torch.ones(len(alphas)))
        state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 8), ctx.client_id), ctx)
        new, upload, _ = alg.local_train(payload, state, ctx)
        uploads.append({**upload, "client_id": ctx.client_id})
        model = FlocoModel(ctx, payload["global"], M1)
        floco_training_loop(model, batch_pairs(ctx, "train", 2), alphas, floco_optimizer(model, ctx))
        expected = model.as_dict()
        assert set(upload["params"]) == set(expected)
        assert_expected_close(upload["params"], expected)
        assert_expected_close(new["model"], expected)
        trained.append(expected)
    # FedAvgServer.aggregate (return_diff = False): every public parameter, endpoints included, is the
    # sample-weighted average of the clients' over the round's participants
    n = torch.tensor([float(c.num_train) for c in ctxs])
    w = n / n.sum()
    merged = alg.aggregate(server, uploads, 1)["global"]
    assert_expected_close(merged, {k: w[0] * trained[0][k] + w[1] * trained[1][k] for k in trained[0]})
    # the gradient reaching endpoint m is alpha_m times the realised weight's gradient
    ctx = ctxs[0]
    model = FlocoModel(ctx, server["global"], M1)
    alpha = [0.2, 0.5, 0.3]
    model.classifier.alphas = alpha
    x, y = batch_pairs(ctx)[0]
    weight = sum(a * w for a, w in zip(alpha, model.classifier._weights))
    weight.retain_grad()
    F.cross_entropy(F.linear(model.base(x, stop=BODY), weight, model.classifier.bias), y).backward()
    for m in range(M1):
        torch.testing.assert_close(model.classifier._weights[m].grad, alpha[m] * weight.grad, rtol=RTOL, atol=ATOL)

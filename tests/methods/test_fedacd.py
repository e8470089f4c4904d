"""FedACD (docs/reference/methods/fedacd.md): the probability matrix P and its re-estimation, the
flattening KL (Eq. 7), the logit adjustment (Eq. 8), the loss, the template score and its
aggregation (Eq. 10, 11), each against a computation by hand (FedACD has no public code: a
reconstruction)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms.base import ROUND_INFO
from pflkit.algorithms.context import TrainBatches
from pflkit.algorithms.fedacd import adjustment, fedacd_loss, flattening_kl, reestimate
from pflkit.config import load_config
from pflkit.functional.training import Batch, probability_matrix, template_kl
from pflkit.run.experiment import run_experiment
from tests.support.builders import build, params_of, tiny_context


def test_probability_matrix_is_the_mean_prediction_per_true_class():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0], [0.1, 0.8, 0.1]])
    y = torch.tensor([0, 0, 1])
    sums = torch.zeros(3, 3).index_add_(0, y, probs)
    P = probability_matrix(sums, torch.bincount(y, minlength=3))
    torch.testing.assert_close(P[0], torch.tensor([0.6, 0.35, 0.05]))
    torch.testing.assert_close(P[1], torch.tensor([0.1, 0.8, 0.1]))
    torch.testing.assert_close(P[2], torch.full((3,), 1 / 3))  # absent class: uniform, never used
    assert (probability_matrix(torch.zeros(2, 2), torch.tensor([1, 1])) == 1e-8).all()  # floored


def test_fedacd_estimates_P_from_the_received_model_and_reestimates_it_every_epoch():
    ctx = tiny_context(n_train=30)
    glob = params_of(ctx, 2)
    logits = ctx.net(glob, ctx.data.train_x, train=False)
    sums = torch.zeros(10, 10).index_add_(0, ctx.data.train_y, torch.softmax(logits, -1))
    P0 = probability_matrix(sums, ctx.label_counts)
    torch.testing.assert_close(
        P0,
        probability_matrix(
            ctx.class_sums(glob, lambda n, p, x, y: torch.softmax(n(p, x, train=False), -1)), ctx.label_counts
        ),
    )
    carried = {"fedacd.P": P0, "fedacd.sums": sums, "fedacd.weights": ctx.label_counts.float()}
    new = reestimate(0.0)(carried)
    seen = ctx.label_counts > 0
    torch.testing.assert_close(new["fedacd.P"][seen], (sums / ctx.label_counts[:, None])[seen].clamp(min=1e-8))
    assert new["fedacd.sums"].abs().sum() == 0 and new["fedacd.weights"].abs().sum() == 0
    ema = reestimate(0.9)(carried)["fedacd.P"]
    torch.testing.assert_close(ema[seen], 0.9 * P0[seen] + 0.1 * new["fedacd.P"][seen])


def test_flattening_kl_is_eq7_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.5, 0.25, 0.25]])  # q_y = p_y, the rest flat
    expected = float((q * (q.log() - p.log())).sum())
    assert float(flattening_kl(p, p.log(), torch.tensor([0]))) == pytest.approx(expected, rel=1e-6)


def test_logit_adjustment_is_eq8_by_hand_with_missing_classes():
    P = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    counts = torch.tensor([5, 3, 0])
    shift = adjustment(P, counts, tau=1.0, eps_missing=0.01)
    assert shift[0, 1] == pytest.approx(math.log(0.3 / 0.1)) and shift[1, 0] == pytest.approx(math.log(0.1 / 0.3))
    assert shift[0, 2] == pytest.approx(math.log(0.01)) and shift[1, 2] == pytest.approx(math.log(0.01))
    assert torch.all(torch.diagonal(shift) == 0)
    z = torch.tensor([[2.0, 1.0, 0.5]])
    adjusted = z + shift[0]  # label 0
    expected = -math.log(math.exp(2.0) / (math.exp(2.0) + 3 * math.exp(1.0) + 0.01 * math.exp(0.5)))
    assert float(F.cross_entropy(adjusted, torch.tensor([0]))) == pytest.approx(expected, rel=1e-6)


def test_fedacd_loss_is_la_plus_lambda_kl_and_carries_the_batch_statistics():
    ctx = tiny_context(n_train=10)
    params = params_of(ctx, 1)
    P = torch.full((10, 10), 0.1)
    cfg = build("fedacd", ctx, "fedacd.lam=2.0").settings
    carried = {"fedacd.P": P, "fedacd.sums": torch.zeros(10, 10), "fedacd.weights": torch.zeros(10)}
    batch = Batch(ctx.data.train_x, ctx.data.train_y)
    value, out = fedacd_loss(cfg, 10)(ctx.net, {**params, **carried}, batch, {"counts": ctx.label_counts})
    logits = ctx.net(params, batch.x)
    la = F.cross_entropy(logits + adjustment(P, ctx.label_counts, 1.0, 0.01)[batch.y], batch.y)
    kl = flattening_kl(logits.softmax(-1), logits.log_softmax(-1), batch.y).mean()
    torch.testing.assert_close(value, la + 2.0 * kl)
    torch.testing.assert_close(out["fedacd.weights"], torch.bincount(batch.y, minlength=10).float())
    torch.testing.assert_close(out["fedacd.sums"].sum(1), out["fedacd.weights"])  # every row sums its samples


def test_template_score_and_softmax_aggregation():
    P = torch.tensor([[0.9, 0.1], [0.3, 0.7]])
    gamma = 0.9
    T = torch.tensor([[0.9, 0.1], [0.1, 0.9]])
    rows = (P * (P.log() - T.log())).sum(1)
    assert float(template_kl(P, torch.tensor([4, 2]), gamma)) == pytest.approx(float(rows.mean()), rel=1e-6)
    assert float(template_kl(P, torch.tensor([4, 0]), gamma)) == pytest.approx(float(rows[0]), abs=1e-7)
    # fedacd.score_rows = "samples": rows weighted by the class counts
    assert float(template_kl(P, torch.tensor([4, 2]), gamma, "samples")) == pytest.approx(
        float((4 * rows[0] + 2 * rows[1]) / 6), rel=1e-6
    )
    ctx = tiny_context()
    server = {"global": params_of(ctx, 1)}
    a, b = params_of(ctx, 2), params_of(ctx, 3)
    uploads = [
        {"params": a, "num_samples": 10, "score": 0.5, "client_id": 0},
        {"params": b, "num_samples": 30, "score": 1.5, "client_id": 1},
    ]
    for agg, weights in (
        ("softmax_neg_score", [math.exp(-0.5), math.exp(-1.5)]),
        ("uniform", [1, 1]),
        ("samples", [10, 30]),
        ("inverse_score", [2.0, 1 / 1.5]),
        ("softmax_neg_score_x_n", [10 * math.exp(-0.5), 30 * math.exp(-1.5)]),
    ):
        alg = build("fedacd", ctx, f'fedacd.agg="{agg}"')
        out = alg.aggregate(server, uploads, 1)
        wa, wb = weights[0] / sum(weights), weights[1] / sum(weights)
        for k in a:
            torch.testing.assert_close(out["global"][k], wa * a[k] + wb * b[k])
        # the weights go into the round's record (the driver moves ROUND_INFO there)
        info = out[ROUND_INFO]["aggregation"]
        assert (info["clients"], info["scores"], info["samples"]) == ([0, 1], [0.5, 1.5], [10, 30])
        assert info["weights"] == pytest.approx([wa, wb])


@pytest.mark.integration
def test_fedacd_records_its_aggregation_weights_every_round_and_its_own_mixup_setting_wins(tmp_path):
    config = load_config(
        None,
        [
            "dataset=synthetic",
            "num_clients=4",
            "alpha=0.5",
            "rounds=2",
            "lr=0.05",
            'algorithms=["fedacd"]',
            "mixup=true",
            "fedacd.mixup=false",
            "engine=loop",
        ],
    )
    seen = []
    real = TrainBatches.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append(self.mixup)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TrainBatches, "__init__", spy)
        run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    assert seen and not any(seen)  # fedacd.mixup = false holds although the run's mixup is true
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "aggregation" in r]
    assert [r["round"] for r in trained] == [1, 2]
    for r in trained:
        agg = r["aggregation"]
        assert sorted(agg["clients"]) == [0, 1, 2, 3] and sum(agg["weights"]) == pytest.approx(1.0)
        expected = torch.softmax(-torch.tensor(agg["scores"], dtype=torch.float64), 0).tolist()
        assert agg["weights"] == pytest.approx(expected)


def test_fedacd_round_uploads_its_score():
    ctx = tiny_context(n_train=30)
    glob = params_of(ctx, 2)
    alg = build("fedacd", ctx)
    state, _ = alg.local_init({"global": glob}, alg.init_client(glob, 0), ctx)
    new, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    P = probability_matrix(
        ctx.class_sums(new["model"], lambda n, p, x, y: torch.softmax(n(p, x, train=False), -1)), ctx.label_counts
    )
    assert float(upload["score"]) == pytest.approx(float(template_kl(P, ctx.label_counts, 0.9)), rel=1e-6)
    assert metrics["score"] == upload["score"]


@pytest.mark.parametrize("p_update", ["epoch", "round"])
def test_fedacd_p_update_decides_whether_P_follows_the_epochs(p_update, monkeypatch):
    """p_update = "round" trains all epochs against the round-start P; "epoch" re-estimates it."""
    import pflkit.algorithms.fedacd as fedacd

    seen = []
    original = fedacd.adjustment
    monkeypatch.setattr(fedacd, "adjustment", lambda P, *a: (seen.append(P.detach().clone()), original(P, *a))[1])
    ctx = tiny_context(n_train=20)
    ctx.train = ctx.train.model_copy(update={"local_epochs": 2})
    alg = build("fedacd", ctx, f'fedacd.p_update="{p_update}"', "fedacd.mixup=false")
    alg.local_train({"global": params_of(ctx, 1)}, {"model": params_of(ctx, 1)}, ctx)
    per_epoch = len(seen) // 2
    assert per_epoch >= 1 and len(seen) == 2 * per_epoch
    first, second = seen[0], seen[per_epoch]
    assert all(torch.equal(first, P) for P in seen[:per_epoch])  # fixed within an epoch
    assert torch.equal(first, second) == (p_update == "round")

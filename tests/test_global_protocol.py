"""The official-test-set protocol, the global-model metrics, and the local optimiser options."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pflkit.config import ConfigError, load_config
from pflkit.data import Dataset, PartitionSpec
from pflkit.data.federated import FederatedData, official_split
from pflkit.data.partition.holdout import local_test_sets
from pflkit.data.partition.spec import largest_remainder
from pflkit.federation import GlobalEvaluation
from pflkit.functional import SGD
from pflkit.functional.training import Batch, cross_entropy, forward, mix
from pflkit.models import build_model
from pflkit.run.experiment import run_experiment

from helpers import tiny_context

FAST = ["dataset=synthetic", "num_clients=4", "alpha=0.5", "rounds=2", "lr=0.05", "test_set=official"]


def pool(n_train: int = 600, n_test: int = 200, classes: int = 5) -> Dataset:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, classes, (n_train + n_test,), generator=g)
    x = torch.randn(n_train + n_test, 1, 8, 8, generator=g)
    return Dataset("toy", x, y, classes, official_train=n_train)


def test_official_protocol_partitions_the_training_split_and_draws_local_test_sets():
    data = pool()
    fed = FederatedData.build(data, PartitionSpec(num_clients=6, alpha=0.3, test_set="official",
                                                  min_samples_per_client=10), seed=1)
    train_rows = np.concatenate([c.train_rows.numpy() for c in fed.clients])
    assert sorted(train_rows.tolist()) == list(range(600))  # the whole training split, disjoint
    assert torch.equal(fed.global_test_rows, torch.arange(600, 800))  # the official test split
    for client in fed.clients:
        assert client.num_test == 200 // 6 and (client.test_rows >= 600).all()  # drawn from the test split
        counts = np.bincount(client.train_y.numpy(), minlength=5)
        expected = largest_remainder(counts, 200 // 6)
        assert np.bincount(client.test_y.numpy(), minlength=5).tolist() == expected.tolist()
        assert len(set(client.test_rows.tolist())) == client.num_test  # no repeats within a client
    assert fed.partition_info["test_set"] == "official" and fed.partition_info["local_test_size"] == 33


def test_largest_remainder_and_local_test_sets_reuse_samples_across_clients():
    assert largest_remainder(np.array([3, 1, 0, 2]), 10).tolist() == [5, 2, 0, 3]
    assert largest_remainder(np.array([1, 1, 1]), 2).tolist() == [1, 1, 0]  # ties: lower index first
    test_labels = np.array([0] * 3 + [1] * 30)
    sets = local_test_sets(np.array([[10, 0], [10, 0]]), test_labels, 5, np.random.default_rng(0))
    assert all(len(s) == 5 and set(test_labels[s]) == {0} for s in sets)  # 5 from a pool of 3: with repeats
    with pytest.raises(Exception, match="holds no sample"):
        local_test_sets(np.array([[1, 1, 1]]), np.array([0, 1]), 4, np.random.default_rng(0))


def test_datasets_without_an_official_split_use_a_fixed_stratified_one():
    data = Dataset("toy", torch.randn(100, 1, 8, 8), torch.arange(100) % 4, 4)
    train, test = official_split(data)
    assert len(test) == 25 and sorted(np.bincount(data.y.numpy()[test]).tolist()) == [6, 6, 6, 7]
    again = official_split(data)
    assert np.array_equal(train, again[0]) and not set(train) & set(test)


def test_global_evaluation_scores_classes_and_client_distributions():
    class Fixed(torch.nn.Module):  # predicts class 0 for every input
        def forward(self, x):
            return torch.tensor([[1.0, 0.0]]).repeat(len(x), 1)

    y = torch.tensor([0, 0, 1, 1, 1])
    priors = np.array([[1.0, 0.0], [0.25, 0.75]])
    evaluation = GlobalEvaluation(Fixed(), torch.zeros(5, 1), y, 2, priors)
    out = evaluation({})
    assert out["global_accuracy"] == pytest.approx(0.4)
    assert out["global_class_accuracy"] == [1.0, 0.0]
    assert out["global_client_accuracy"] == pytest.approx((1.0 + 0.25) / 2)
    assert evaluation.local_risk([2, 0]) == pytest.approx(1 - (1.0 + 0.25) / 2)


@pytest.mark.parametrize("pure", [True, False], ids=["pflkit-model", "torch-module"])
def test_global_evaluation_gives_the_same_numbers_for_any_number_of_workers(pure):
    """The parallel engine evaluates test batches on its worker threads; the sums are added in batch
    order with a fixed intra-op thread count, so the workers must not change a single bit."""
    torch.manual_seed(0)
    model = build_model("digits_cnn", (1, 8, 8), 5) if pure else torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = torch.randn(230, 1, 8, 8), torch.randint(0, 5, (230,))
    priors = np.full((3, 5), 0.2)
    runs = [GlobalEvaluation(model, x, y, 5, priors, batch_size=16, workers=w)(params) for w in (1, 2, 3)]
    for run in runs:
        run.pop("global_eval_seconds")
    assert runs[0] == runs[1] == runs[2]
    with torch.no_grad():  # and the same as one forward over the whole set
        logits = forward(model, params, x)
    assert runs[0]["global_accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert runs[0]["global_test_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)))


def test_official_runs_record_global_local_and_adaptability_metrics(tmp_path):
    cfg = load_config(None, FAST + ['algorithms=["fedavg","fedrep","fedala"]', "metrics.adaptability=true"])
    summary = run_experiment(cfg, tmp_path, progress=False, echo=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    fedavg = [r for r in records if r["algorithm"] == "fedavg"]
    assert all("global_accuracy" in r and len(r["global_class_accuracy"]) == 10 for r in fedavg)
    assert all(r["local_accuracy"] == pytest.approx(r["mean_client_accuracy"]) for r in fedavg)
    assert "local_risk" in fedavg[1] and "local_kl" in fedavg[1]
    assert not any("global_accuracy" in r for r in records if r["algorithm"] == "fedrep")  # no global model
    for key in ("best_global_accuracy", "final_global_client_accuracy", "best_local_accuracy", "final_local_risk"):
        assert key in summary["fedavg"] and f"{key}_std" in summary["fedavg"]
    assert (tmp_path / "plots" / "global_accuracy.png").is_file()


@pytest.mark.parametrize("overrides,needle", [
    (["dataset=pfllib", "data_dir=/x", "test_set=official"], "PFLlib folder holds only per-client splits"),
    (["momentum=1.0"], "momentum: must be < 1"),
    (["mixup_alpha=0.0"], "mixup_alpha: must be > 0"),
    (['fedacd.agg="median"'], "fedacd.agg: must be one of"),
    (["metrics.adaptability=true"], "needs test_set = \"official\""),
])
def test_bad_protocol_and_optimiser_settings_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(None, overrides)


def test_sgd_momentum_and_weight_decay_match_torch_optim():
    w0 = torch.randn(5)
    grads = [torch.randn(5) for _ in range(4)]
    ours = {"w": w0.clone()}
    opt = SGD(0.1, momentum=0.9, weight_decay=0.01)
    state = opt.init(ours)
    ref = torch.nn.Parameter(w0.clone())
    torch_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01)
    for g in grads:
        opt.update_(ours, {"w": g}, state)
        ref.grad = g.clone()
        torch_opt.step()
    torch.testing.assert_close(ours["w"], ref.detach())


def test_mixup_batches_mix_inputs_and_weigh_both_labels():
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    perm = torch.tensor([1, 0, 3, 2])
    batch = mix(x, y, 0.3, perm)
    torch.testing.assert_close(batch.x, 0.3 * x + 0.7 * x[perm])
    logits = torch.randn(4, 5)
    expected = 0.3 * torch.nn.functional.cross_entropy(logits, y) + 0.7 * torch.nn.functional.cross_entropy(
        logits, y[perm])
    torch.testing.assert_close(cross_entropy(logits, batch), expected)
    ctx = tiny_context()
    plain = [b for b in ctx.batches()]
    ctx.train = type(ctx.train)(**{**ctx.train.__dict__, "mixup": True})
    mixed = [b for b in ctx.batches()]
    assert all(m.lam is not None and torch.equal(m.y, p.y) for m, p in zip(mixed, plain))  # same order, mixed
    assert not torch.equal(mixed[0].x, plain[0].x)
    with pytest.raises(ValueError, match="mixup needs real-valued inputs"):
        mix(torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 1]), 0.5, torch.tensor([1, 0]))


def test_label_loss_of_a_plain_batch_is_unchanged_by_the_mixup_machinery():
    logits, y = torch.randn(6, 4), torch.randint(0, 4, (6,))
    assert torch.equal(cross_entropy(logits, Batch(torch.zeros(6), y)), torch.nn.functional.cross_entropy(logits, y))


def test_a_parallel_run_gives_the_same_records_for_any_number_of_workers(tmp_path):
    """One config, one set of numbers: the workers of the parallel engine change the speed only
    (ALA's batched start, the clients' training and the global test evaluation included)."""
    records = []
    for workers in (1, 2):
        cfg = load_config(None, FAST + ['algorithms=["fedavg","fedala"]', "engine=parallel", f"workers={workers}"])
        run_experiment(cfg, tmp_path / str(workers), progress=False, echo=lambda s: None)
        lines = (tmp_path / str(workers) / "metrics.jsonl").read_text().splitlines()
        records.append([{k: v for k, v in json.loads(line).items() if "seconds" not in k} for line in lines])
    assert records[0] == records[1]
    assert any("global_test_loss" in r for r in records[0])

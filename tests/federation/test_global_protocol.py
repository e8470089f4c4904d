"""The global protocol (the official test split): the global evaluation's scores, the same for any
number of workers, and runs that record the global, local and adaptability metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pflkit.config import ConfigError, load_config
from pflkit.federation import GlobalEvaluation
from pflkit.functional.training import forward
from pflkit.models import build_model
from pflkit.run.experiment import run_experiment

FAST = ["dataset=synthetic", "num_clients=4", "alpha=0.5", "rounds=2", "lr=0.05", "test_set=official"]


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
    model = (
        build_model("digits_cnn", (1, 8, 8), 5)
        if pure
        else torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    )
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


@pytest.mark.integration
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


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["dataset=pfllib", "data_dir=/x", "test_set=official"], "PFLlib folder holds only per-client splits"),
        (["momentum=1.0"], "momentum: must be < 1"),
        (["mixup_alpha=0.0"], "mixup_alpha: must be > 0"),
        (['fedacd.agg="median"'], "fedacd.agg: must be one of"),
        (["metrics.adaptability=true"], 'needs test_set = "official"'),
    ],
)
def test_bad_protocol_and_optimiser_settings_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(None, overrides)


@pytest.mark.integration
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

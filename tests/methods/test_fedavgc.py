"""FedAvg-C and FedProx-C (docs/reference/methods/fedavgc.md, fedproxc.md): fine-tuning of the
received global model before it is scored, each step recomputed by hand (no author code: FedALA's
text)."""

from __future__ import annotations

import pytest
import torch

from tests.support.builders import build, params_of, tiny_context
from tests.support.references import sgd_reference


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
    conv = build(
        "fedavgc",
        ctx,
        "fedavgc.ft_until_converged=true",
        "fedavgc.ft_max_epochs=4",
        "fedavgc.ft_window=2",
        "fedavgc.ft_threshold=1e-9",
    )
    _, info = conv.local_init({"global": glob}, conv.init_client(glob, 0), ctx)
    assert info["ft_epochs"] == 4  # never below 1e-9: stopped by the cap

"""FedLC: the calibrated logits by hand (docs/reference/methods/fedlc.md), and the loss and client
against my transcription of FL-bench (no author code): KarhouTam/FL-bench 06e658b (file last changed
in 809b988), ``src/client/fedlc.py``, ``src/server/fedlc.py``."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms.fedlc import calibrated_logits
from pflkit.functional.training import Batch
from tests.support.builders import batch_pairs, build, params_of, seeded_client
from tests.support.checks import ATOL, RTOL, assert_expected_close
from tests.support.references import module_at, weights


def test_fedlc_calibration_subtracts_tau_n_to_the_minus_quarter_and_drops_absent_classes():
    z = torch.tensor([[1.0, 2.0, 3.0]])
    out = calibrated_logits(z, torch.tensor([16, 1, 0]), tau=2.0)
    torch.testing.assert_close(out[0, :2], torch.tensor([1.0 - 2.0 * 0.5, 2.0 - 2.0]))
    assert out[0, 2] == float("-inf")
    loss = F.cross_entropy(out, torch.tensor([0]))
    assert math.isfinite(float(loss))


# ============================================================================ FL-bench


def fedlc_reference_loss(logit: torch.Tensor, y: torch.Tensor, train_y: torch.Tensor, tau: float) -> torch.Tensor:
    """My transcription of FL-bench src/client/fedlc.py logit_calibrated_loss: class counts of the
    client's training set, 1e-8 for a class it lacks; cal = exp(logit - tau * count^(-1/4));
    loss = sum over the batch of -log(cal_y / sum_j cal_j), divided by the batch size."""
    present = {int(c): int(n) for c, n in zip(*torch.unique(train_y, return_counts=True))}
    counts = torch.tensor([present.get(i, 1e-8) for i in range(logit.shape[1])], dtype=torch.float32)
    cal = torch.exp(logit - tau * counts.pow(-0.25)[None, :])
    picked = cal.gather(1, y[:, None])[:, 0]
    return -(picked / cal.sum(dim=1)).log().sum() / logit.shape[0]


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_fedlc_matches_fl_benchs_calibrated_loss_and_client(tau):
    from pflkit.algorithms.fedlc import fedlc_loss

    ctx = seeded_client(30, seed=4, classes=[0, 1, 2, 3, 7], lr=0.1, epochs=2)  # five classes absent
    alg = build("fedlc", ctx, f"fedlc.tau={tau}")
    glob = params_of(ctx, 2)
    x, y = batch_pairs(ctx)[0]
    ours = fedlc_loss(tau)(ctx.net, glob, Batch(x, y), {"counts": ctx.label_counts})
    theirs = fedlc_reference_loss(module_at(ctx.model, glob)(x), y, ctx.data.train_y, tau)
    torch.testing.assert_close(ours, theirs.detach(), rtol=RTOL, atol=ATOL)
    state, _ = alg.local_init({"global": glob}, alg.init_client(params_of(ctx, 5), 0), ctx)
    new, _, _ = alg.local_train({"global": glob}, state, ctx)
    model = module_at(ctx.model, glob)
    opt = torch.optim.SGD(model.parameters(), lr=ctx.train.lr)  # FedAvgClient's loop with this criterion
    for bx, by in batch_pairs(ctx, "train", 2):
        opt.zero_grad()
        fedlc_reference_loss(model(bx), by, ctx.data.train_y, tau).backward()
        opt.step()
    assert_expected_close(new["model"], weights(model))

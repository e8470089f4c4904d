"""FedProx-C (docs/reference/methods/fedproxc.md): its fine-tuning with the proximal term,
recomputed by hand (the round shared with FedAvg-C is in test_fedavgc.py)."""

from __future__ import annotations

import torch

from tests.support.builders import build, params_of, tiny_context
from tests.support.references import sgd_reference


def test_fedproxc_finetunes_with_the_proximal_term_only_when_asked():
    ctx = tiny_context()
    glob, local = params_of(ctx, 2), params_of(ctx, 1)
    alg = build("fedproxc+ala", ctx, "fedproxc.mu=2.0", "fedproxc.ft_prox=true")
    plain = build("fedproxc", ctx, "fedproxc.mu=2.0", "fedproxc.ft_prox=true")
    state, _ = plain.local_init({"global": glob}, plain.init_client(local, 0), ctx)
    expected = sgd_reference(ctx, glob, "finetune", 1, prox_anchor=glob, prox_mu=2.0)
    torch.testing.assert_close(state["model"], expected)
    assert alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)[0]["model"].keys() == glob.keys()

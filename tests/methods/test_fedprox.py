"""FedProx: the proximal term by itself, and against my transcription of PFLlib f1e313a
(``clients/clientprox.py``, ``optimizers/fedoptimizer.py``: PerturbedGradientDescent)."""

from __future__ import annotations

import torch

from tests.support.builders import batch_pairs, build, params_of, tiny_context, two_client_round
from tests.support.checks import assert_params_close, moved
from tests.support.references import (
    network,
    pfllib_fedavg_client,
    pfllib_perturbed_epochs,
    pfllib_server_average,
    weights,
)


def test_fedprox_with_zero_mu_equals_fedavg_and_large_mu_stays_near_global():
    ctx = tiny_context()
    glob = params_of(ctx, 2)
    results = {}
    for name, mu in [("fedavg", None), ("fedprox", "0.0"), ("fedprox", "5.0")]:
        alg = build(name, ctx, *([f"fedprox.mu={mu}"] if mu else []))
        state, _ = alg.local_init({"global": glob}, alg.init_client(glob, 0), ctx)
        results[(name, mu)] = alg.local_train({"global": glob}, state, ctx)[1]["params"]
    for k in glob:
        torch.testing.assert_close(results[("fedprox", "0.0")][k], results[("fedavg", None)][k])
    dist = lambda p: sum(((p[k] - glob[k]) ** 2).sum() for k in glob)  # noqa: E731
    assert dist(results[("fedprox", "5.0")]) < dist(results[("fedavg", None)])


def pfllib_fedprox_client(ctx, glob: dict, lr: float, mu: float) -> dict:
    """clientprox.py: ``set_parameters`` stores the received tensors as ``global_params`` and loads
    them; ``train`` runs E epochs of PerturbedGradientDescent toward ``global_params``."""
    anchor = {k: v.clone() for k, v in glob.items()}
    net = network(ctx, glob)
    pfllib_perturbed_epochs(net, anchor, batch_pairs(ctx, "train", ctx.train.local_epochs), lr, mu)
    return weights(net)


def test_fedprox_is_pfllib_perturbed_gradient_descent_toward_the_received_global():
    ctxs = [tiny_context(n_train=30, seed=0, epochs=2), tiny_context(n_train=20, seed=1, epochs=2)]
    glob = params_of(ctxs[0], 2)
    mu = 0.5  # large enough that the proximal term changes the result far beyond the tolerance
    _, server, states, uploads = two_client_round("fedprox", ctxs, glob, f"fedprox.mu={mu}")
    expected = [pfllib_fedprox_client(ctx, glob, lr=0.1, mu=mu) for ctx in ctxs]
    for state, upload, ref in zip(states, uploads, expected):
        assert_params_close(state["model"], ref)
        assert_params_close(upload["params"], ref)
    assert moved(expected[0], pfllib_fedavg_client(ctxs[0], glob, lr=0.1))  # the term matters here
    assert_params_close(server["global"], pfllib_server_average(expected, [30, 20]))

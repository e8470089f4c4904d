"""The client contexts the engines hand to client code: ``fit`` is plain gradient descent,
``batches`` drop the last partial batch but never leave a client without one, and the learning-rate
decay reaches training on the single and the batched context."""

from __future__ import annotations

import pytest
import torch

from pflkit.algorithms import TrainBatches
from pflkit.config import load_config
from pflkit.functional import classification_loss, proximal_loss
from tests.support.builders import build, params_of, tiny_context
from tests.support.references import sgd_reference


def test_fit_step_is_plain_gradient_descent_with_proximal_term():
    ctx = tiny_context(n_train=10, batch_size=10, lr=0.5)
    p0, anchor = params_of(ctx, 1), params_of(ctx, 2)
    batch = [(ctx.data.train_x, ctx.data.train_y)]
    new = ctx.fit(p0, proximal_loss(classification_loss, 0.3), aux={"anchor": anchor}).params
    leaves = {k: v.clone().requires_grad_(True) for k, v in p0.items()}
    loss = torch.nn.functional.cross_entropy(torch.func.functional_call(ctx.model, leaves, (batch[0][0],)), batch[0][1])
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    for k in p0:
        expected = p0[k] - 0.5 * (grads[k] + 0.3 * (p0[k] - anchor[k]))
        torch.testing.assert_close(new[k], expected, rtol=1e-5, atol=1e-6)


def test_batches_drop_last_but_small_clients_train_on_one_batch():
    ctx = tiny_context(n_train=25, batch_size=10)
    sizes = [len(b.y) for b in ctx.batches(TrainBatches("train", 2))]
    assert sizes == [10, 10, 10, 10]
    small = tiny_context(n_train=4, batch_size=10)
    assert [len(b.y) for b in small.batches(TrainBatches("train", 1))] == [4]
    again = [b.y.tolist() for b in ctx.batches(TrainBatches("train", 1))]
    assert again == [b.y.tolist() for b in ctx.batches(TrainBatches("train", 1))]  # same stream, same order


# ---- learning-rate decay (FedNH's and FedNTD's code: lr * 0.99^(r-1)) -------------------------------


def test_lr_decay_trains_round_r_at_lr_times_decay_to_the_r_minus_1():
    from pflkit.algorithms import TrainSettings
    from pflkit.engines.client import SingleClientContext

    base = tiny_context(n_train=30)
    train = TrainSettings(batch_size=10, local_epochs=1, lr=0.1, lr_decay=0.5, rounds=5)
    assert [train.at_round(r).lr for r in (0, 1, 2, 3, 5, 6)] == [0.1, 0.1, 0.05, 0.025, 0.00625, 0.00625]
    assert TrainSettings(lr=0.1).at_round(7).lr == 0.1
    glob = params_of(base, 2)
    for engine_context in ("single", "batched"):
        ctx = SingleClientContext(
            client_id=0,
            round=3,
            seed=0,
            data=base.data,
            model=base.model,
            units=base.units,
            train=train,
            algorithm="test",
        )
        assert ctx.train.lr == 0.025
        alg = build("fedavg", ctx)
        if engine_context == "single":
            trained = alg.local_train({"global": glob}, {"model": dict(glob)}, ctx)[0]["model"]
        else:  # the batched context of the vmap and parallel engines decays the same way
            from pflkit.data.federated import FederatedData
            from pflkit.engines.batched import BatchedClientContext
            from pflkit.engines.stacking import stack, unstack

            fed = FederatedData.from_clients([base.data], 10, "toy")
            bctx = BatchedClientContext([0], 3, 0, fed, base.model, base.units, train, "test")
            assert bctx.train.lr == 0.025
            out = alg.local_train(stack([{"global": glob}]), stack([{"model": dict(glob)}]), bctx)[0]
            trained = unstack(out, 0, {"model": glob})["model"]
        torch.testing.assert_close(trained, sgd_reference(ctx, glob, "train", 1, lr=0.025), rtol=1e-5, atol=1e-6)


def test_lr_decay_is_a_config_key_that_reaches_training():
    config = load_config(None, ["lr_decay=0.99"])
    assert config.train.lr_decay == 0.99
    with pytest.raises(Exception, match="lr_decay"):
        load_config(None, ["lr_decay=1.5"])

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


# ---- closed-form loss terms (FedProx's pull, SCAFFOLD's correction, FedDyn's terms) ----------------


def _objectives():
    """(loss with closed-form terms, the aux it reads) for each kind of term, from parameter dicts."""
    from pflkit.algorithms.feddyn import feddyn_loss
    from pflkit.algorithms.scaffold import corrected_loss

    def feddyn_aux(anchor, grad):
        coef = {k: grad[k] + 0.1 * a for k, a in anchor.items()}
        return {"coef": coef, "anchor_sq": sum((a**2).sum() for a in anchor.values())}

    return [
        (proximal_loss(classification_loss, 0.3), lambda anchor, other: {"anchor": anchor}),
        (corrected_loss(classification_loss), lambda anchor, other: {"correction": other}),
        (feddyn_loss(0.1), feddyn_aux),
    ]


def test_closed_form_terms_train_as_autograd_of_the_whole_objective_bit_for_bit():
    """A loss with closed-form terms trains to the numbers of the same objective differentiated
    whole by autograd, parameters and losses bit for bit, on one client and on a batched context
    of clients with unequal step counts."""
    from pflkit.data.federated import FederatedData
    from pflkit.engines.batched import BatchedClientContext
    from pflkit.engines.stacking import stack, unstack
    from pflkit.functional.training import WithTerms
    from tests.support.builders import client_context, perturbed

    contexts = [
        client_context(i, n_train=n, data_seed=i, batch_size=10, lr=0.2, local_epochs=2)
        for i, n in enumerate((30, 14, 50))
    ]
    p0 = params_of(contexts[0], 1)
    fed = FederatedData.from_clients([c.data for c in contexts], 10, "toy")
    batched = BatchedClientContext([0, 1, 2], 1, 0, fed, contexts[0].model, contexts[0].units, contexts[0].train, "t")
    for loss, make_aux in _objectives():
        assert isinstance(loss, WithTerms)
        whole = lambda *args, loss=loss: loss(*args)  # noqa: E731  (a plain function: autograd of every part)
        auxes = [
            make_aux(perturbed(p0, 10 + i, 0.1), perturbed({k: 0 * v for k, v in p0.items()}, 20 + i, 0.05))
            for i in range(3)
        ]
        for ctx, aux in zip(contexts, auxes):
            ours, theirs = ctx.fit(p0, loss, aux=aux), ctx.fit(p0, whole, aux=aux)
            assert all(torch.equal(ours.params[k], theirs.params[k]) for k in p0), loss
            assert torch.equal(torch.as_tensor(ours.loss), torch.as_tensor(theirs.loss))
        start, aux = stack([p0] * 3), stack(auxes)
        ours, theirs = batched.fit(start, loss, aux=aux), batched.fit(start, whole, aux=aux)
        assert all(torch.equal(ours.params[k], theirs.params[k]) for k in p0), loss
        assert torch.equal(ours.loss, theirs.loss)
        assert not torch.equal(unstack(ours.params, 0, p0)["fc.weight"], p0["fc.weight"])  # it trained


@pytest.mark.parametrize("name", ["fedlc", "fedrod"])
def test_a_padding_row_of_a_class_the_client_lacks_leaves_the_loss_finite_on_vmap(name):
    """FedLC and FedRoD give a class the client lacks the logit -inf. The vmap engine pads a short
    batch with row 0 of the data, here of class 9, which client 4 lacks: its infinite loss is
    dropped from the batch mean (0 * inf was NaN and stopped the run), and vmap gives the loop
    engine's numbers."""
    from pflkit.engines import LoopEngine, VmapEngine
    from tests.support.builders import make_data, run_rounds
    from tests.support.checks import assert_states_close

    data = make_data([30, 45, 12, 60, 7], seed=2)
    assert int(data.y[0]) == 9 and 9 not in data.clients[4].train_y.tolist()
    loop = run_rounds(name, LoopEngine(), data, rounds=1)
    assert_states_close(loop, run_rounds(name, VmapEngine(), data, rounds=1), atol=1e-5)

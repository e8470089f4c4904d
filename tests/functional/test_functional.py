"""pflkit.functional: weighted averages and their streaming sum, the optimiser (momentum, weight
decay, global-norm clipping), mixup and the label loss, ensembles."""

from __future__ import annotations

import math

import pytest
import torch

from pflkit.functional import SGD, WeightedSum, weighted_average
from pflkit.functional.training import (
    Batch,
    clip_by_global_norm,
    cross_entropy,
    evaluate,
    forward,
    in_row_chunks,
    mix,
    prediction_logits,
)
from pflkit.models import build_model
from tests.support.builders import params_of, tiny_context


def test_weighted_average_is_sample_weighted():
    a = {"w": torch.tensor([0.0, 2.0])}
    b = {"w": torch.tensor([4.0, 6.0])}
    out = weighted_average([a, b], [1, 3])
    torch.testing.assert_close(out["w"], torch.tensor([3.0, 5.0]))


def test_weighted_sum_gives_the_bits_of_weighted_average():
    g = torch.Generator().manual_seed(0)
    models = [{"w": torch.randn(7, 3, generator=g), "b": torch.randn(3, generator=g)} for _ in range(9)]
    weights = [13, 1, 500, 7, 7, 60, 2, 99, 31]
    total = WeightedSum(sum(weights))
    for model, w in zip(models, weights):
        total.add(model, w)
    expected = weighted_average(models, weights)
    assert all(torch.equal(total.result()[k], expected[k]) for k in expected)


def test_weighted_sum_refuses_weights_that_do_not_add_up():
    total = WeightedSum(10)
    total.add({"w": torch.ones(2)}, 4)
    with pytest.raises(ValueError, match="sum to 4, not to the 10 announced"):
        total.result()
    with pytest.raises(ValueError, match="positive"):
        WeightedSum(0)


def test_weighted_sum_accepts_weights_whose_running_sum_misses_the_total_by_rounding():
    """Ten weights of 0.1 add up one by one to 0.9999999999999999, not 1.0 (the compensated sum
    that Python 3.12's ``sum`` returns): FedACD's softmax weights hit this on a GPU machine's Python."""
    weights = [0.1] * 10
    assert math.fsum(weights) == 1.0
    models = [{"w": torch.full((2,), float(i))} for i in range(10)]
    total = WeightedSum(1.0)
    for model, w in zip(models, weights):
        total.add(model, w)
    assert torch.allclose(total.result()["w"], torch.full((2,), 4.5))
    assert torch.allclose(weighted_average(models, weights)["w"], torch.full((2,), 4.5))


def test_weighted_sum_without_a_total_keeps_the_plain_sum_and_divides_it_at_the_end():
    g = torch.Generator().manual_seed(1)
    models = [{"w": torch.randn(4, 3, generator=g)} for _ in range(5)]
    uniform = WeightedSum()
    for model in models:
        uniform.add(model)
    plain = torch.zeros(4, 3)
    for model in models:
        plain.add_(model["w"])
    assert torch.equal(uniform.sum["w"], plain) and uniform.added == 5
    assert torch.equal(uniform.result()["w"], plain / 5)
    with pytest.raises(ValueError, match="empty"):
        WeightedSum().result()


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


def test_sgd_own_weight_decays_match_torch_optims_parameter_groups():
    """``decays`` with ``plain``: GPFL's CoV under SGD(weight_decay=μ) beside a model under the run's
    momentum and weight decay, as two torch optimisers."""
    g = torch.Generator().manual_seed(1)
    w0, v0 = torch.randn(5, generator=g), torch.randn(3, generator=g)
    steps = [(torch.randn(5, generator=g), torch.randn(3, generator=g)) for _ in range(4)]
    ours = {"w": w0.clone(), "cov": v0.clone()}
    opt = SGD(0.1, momentum=0.9, weight_decay=0.01, plain=frozenset({"cov"}), decays={"cov": 0.3})
    state = opt.init(ours)
    w, cov = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(v0.clone())
    model_opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=0.01)
    cov_opt = torch.optim.SGD([cov], lr=0.1, weight_decay=0.3)
    for gw, gv in steps:
        opt.update_(ours, {"w": gw, "cov": gv}, state)
        w.grad, cov.grad = gw.clone(), gv.clone()
        model_opt.step()
        cov_opt.step()
    torch.testing.assert_close(ours["w"], w.detach())
    torch.testing.assert_close(ours["cov"], cov.detach())


def test_sgd_clips_the_global_gradient_norm_like_torch_per_client_when_batched():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, 4, generator=g) * 5, torch.randn(4, generator=g) * 5]
    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(4, requires_grad=True)]
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm=2.0)
    ours = clip_by_global_norm(grads, 2.0)
    for p, c in zip(params, ours):
        torch.testing.assert_close(c, p.grad)
    small = clip_by_global_norm([gr * 1e-3 for gr in grads], 2.0)  # below the norm: unchanged
    torch.testing.assert_close(small[0], grads[0] * 1e-3)
    stacked = clip_by_global_norm(
        [torch.stack([grads[0], grads[0] * 1e-3]), torch.stack([grads[1], grads[1] * 1e-3])], 2.0, batched=True
    )
    torch.testing.assert_close(stacked[0][0], ours[0])
    torch.testing.assert_close(stacked[0][1], grads[0] * 1e-3)


def test_mixup_batches_mix_inputs_and_weigh_both_labels():
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    perm = torch.tensor([1, 0, 3, 2])
    batch = mix(x, y, 0.3, perm)
    torch.testing.assert_close(batch.x, 0.3 * x + 0.7 * x[perm])
    logits = torch.randn(4, 5)
    expected = 0.3 * torch.nn.functional.cross_entropy(logits, y) + 0.7 * torch.nn.functional.cross_entropy(
        logits, y[perm]
    )
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


def test_an_ensemble_is_scored_by_its_mean_softmax() -> None:
    from pflkit.functional import Ensemble, evaluate, forward

    ctx = tiny_context()
    a, b = params_of(ctx, 0), params_of(ctx, 1)
    x, y = ctx.data.test_x, ctx.data.test_y
    probs = (torch.softmax(forward(ctx.model, a, x), -1) + torch.softmax(forward(ctx.model, b, x), -1)) / 2
    out = evaluate(ctx.model, Ensemble([a, b]), x, y)
    assert out["correct"] == int((probs.argmax(1) == y).sum())
    assert out["loss_sum"] == pytest.approx(
        float(torch.nn.functional.nll_loss(probs.log(), y, reduction="sum")), rel=1e-5
    )


def test_row_chunks_split_cpu_forwards_and_keep_other_devices_whole():
    calls: list[int] = []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        return x * 2

    x = torch.arange(150.0)[:, None]
    torch.testing.assert_close(in_row_chunks(double, x), x * 2, rtol=0, atol=0)
    assert calls == [64, 64, 22]
    calls.clear()
    in_row_chunks(double, torch.empty(150, 1, device="meta"))
    assert calls == [150]


@pytest.mark.parametrize(
    "name, shape",
    [("fedavg_cnn", (1, 28, 28)), ("digits_cnn", (1, 8, 8)), ("fedbn_cnn", (3, 28, 28)), ("dnn", (1, 28, 28))],
)
def test_chunked_evaluation_scores_what_one_batch_scores(name: str, shape: tuple[int, ...]):
    """Each row's logits are its own, so the chunks agree with one forward. Only to float rounding
    in general: a chunk's convolution may take another kernel than the whole batch's (on the CPUs
    measured the bits were the same; ``benchmarks/eval_chunks.py`` prints it)."""
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    params = {k: v.detach() for k, v in model.state_dict().items()}
    x, y = torch.randn(300, *shape), torch.randint(0, 10, (300,))
    with torch.no_grad():
        whole = forward(model, params, x, train=False)
        chunked = prediction_logits(model, params, x)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    scores = evaluate(model, params, x, y, batch_size=1000)
    assert scores["correct"] == int((whole.argmax(1) == y).sum())
    assert scores["loss_sum"] == pytest.approx(
        float(torch.nn.functional.cross_entropy(whole, y, reduction="sum")), rel=1e-6
    )

"""FedDecorr's loss and client round against my own transcriptions of the authors' code.

Reference read (written from reading it, not copied): bytedance/FedDecorr 973e4af, ``loss.py``
(``FedDecorrLoss``), ``approach/fedavg.py`` (``FedAvg._local_training``: SGD with momentum
``rho`` and weight decay; per batch ``out, features = net(x, return_features=True)``, loss = CE(out)
+ feddecorr_coef * FedDecorrLoss(features), where ``features`` is the classifier's input),
``networks/resnetcifar.py`` (``return_features``), ``main.py`` (momentum 0.9, weight decay 1e-5),
``run_scripts/cifar10_fedavg_feddecorr.sh`` (coefficient 0.1, lr 0.01).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms.feddecorr import decorrelation, feddecorr_loss
from pflkit.engines import SingleClientContext
from pflkit.functional.training import Batch
from tests.support.builders import batch_pairs, build, client_context, params_of


def reference_decorrelation(x: torch.Tensor) -> torch.Tensor:
    """My transcription of bytedance/FedDecorr loss.py (commit 973e4af, FedDecorrLoss.forward):
    0 for one sample; z = (x - mean) / sqrt(1e-8 + unbiased var); M = z^T z; the mean of M's squared
    off-diagonal entries, divided by N."""
    N, d = x.shape
    if N == 1:
        return torch.zeros(())
    z = (x - x.mean(0)) / torch.sqrt(1e-8 + x.var(0))
    M = z.t() @ z
    off = [M[i, j] ** 2 for i in range(d) for j in range(d) if i != j]
    return torch.stack(off).mean() / N


def test_decorrelation_is_the_authors_loss_and_the_papers_form_is_about_n_times_weaker():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 12, generator=g, dtype=torch.float64) @ torch.randn(12, 12, generator=g, dtype=torch.float64)
    ours = decorrelation(h)
    assert float(ours) == pytest.approx(float(reference_decorrelation(h)), rel=1e-10)
    # padded rows (mask 0) change nothing
    padded = torch.cat([h, torch.randn(5, 12, generator=g, dtype=torch.float64)])
    mask = torch.cat([torch.ones(64), torch.zeros(5)]).double()
    assert float(decorrelation(padded, mask)) == pytest.approx(float(ours), rel=1e-10)
    assert float(decorrelation(h[:1])) == 0.0 == float(decorrelation(h[:1], form="paper"))
    # the paper's form: ||K||_F^2 / d^2; the same gradient direction, (N-1)^2 d / (N (d-1)) times smaller
    z = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5)
    assert float(decorrelation(h, form="paper")) == pytest.approx(float(((z.t() @ z / 64) ** 2).sum() / 144), rel=1e-8)
    grads = [
        torch.autograd.grad(decorrelation(x, form=form), x)[0]
        for form in ("reference", "paper")
        for x in [h.clone().requires_grad_()]
    ]
    assert float(F.cosine_similarity(grads[0].flatten(), grads[1].flatten(), dim=0)) == pytest.approx(1.0, abs=1e-6)
    assert float(grads[0].norm() / grads[1].norm()) == pytest.approx(63**2 * 12 / (64 * 11), rel=1e-3)


# ---- the batch loss and the client round -----------------------------------------------------


BODY = 3  # digits_cnn: conv1, conv2, fc1; fc1's output (64 features) is the classifier's input


def client(
    n_train: int = 40, lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 1e-5, epochs: int = 2
) -> SingleClientContext:
    """Client 0 (data seed 321) and the digits CNN (seed 0) under the authors' optimiser settings."""
    return client_context(
        0,
        n_train=n_train,
        data_seed=321,
        algorithm="feddecorr",
        batch_size=10,
        local_epochs=epochs,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
    )


def authors_decorr(x: torch.Tensor) -> torch.Tensor:
    """FedDecorrLoss.forward: 0 for one sample; centre each column, divide by sqrt(1e-8 + its
    unbiased variance); corr = x^T x; the mean of the squared off-diagonal entries of corr,
    divided by N."""
    N, C = x.shape
    if N == 1:
        return torch.zeros(())
    x = x - x.mean(dim=0, keepdim=True)
    x = x / torch.sqrt(1e-8 + x.var(dim=0, keepdim=True))
    corr = x.t() @ x
    off = corr[~torch.eye(C, dtype=torch.bool)]
    return off.pow(2).mean() / N


class AuthorsNet(nn.Module):
    """The digits CNN with the authors' ``return_features``: the classifier's input and its output."""

    def __init__(self, model: nn.Module, params: dict) -> None:
        super().__init__()
        self.net = copy.deepcopy(model)
        with torch.no_grad():
            for k, v in self.net.named_parameters():
                v.copy_(params[k])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.net(x, stop=BODY)
        return self.net(features, start=BODY), features


def authors_loss(net: AuthorsNet, x, y, coef: float) -> torch.Tensor:
    out, features = net(x)
    return F.cross_entropy(out, y) + coef * authors_decorr(features)


def authors_local_training(
    net: AuthorsNet, batches, lr: float, momentum: float, weight_decay: float, coef: float
) -> list[float]:
    """_local_training: optim.SGD(lr, momentum, weight_decay); per batch zero_grad, loss, backward,
    step. Returns the batches' losses."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = authors_loss(net, x, y, coef)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_feddecorr_batch_loss_is_ce_plus_beta_times_the_authors_loss_of_the_classifier_input(beta):
    ctx = client()
    params = params_of(ctx, 2)
    x, y = batch_pairs(ctx, "train")[0]
    ours = feddecorr_loss(beta, BODY)(ctx.net, params, Batch(x, y), None)
    net = AuthorsNet(ctx.model, params)
    theirs = authors_loss(net, x, y, beta)
    # float32; the same terms, the z-scoring and off-diagonal sum formed in another order: ulps
    torch.testing.assert_close(ours, theirs.detach(), rtol=1.3e-6, atol=0)
    decorr = float(authors_decorr(net(x)[1]).detach())
    assert beta * decorr > 1e-3 * float(theirs.detach())  # the term is well above the tolerance
    # the gradients agree too. The z-scoring divides by sqrt(var + 1e-8), and the columns that ReLU
    # leaves (nearly) constant on this batch (23 of 64) amplify float32 rounding: measured 3e-7 at
    # most on gradients up to 0.17, hence atol 1e-6 beside rtol 1e-5
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ours_grad = torch.autograd.grad(
        feddecorr_loss(beta, BODY)(ctx.net, leaves, Batch(x, y), None), list(leaves.values())
    )
    theirs.backward()
    for (k, p), g in zip(net.net.named_parameters(), ours_grad):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("beta", [None, 0.05])
def test_feddecorr_client_round_is_the_authors_local_training(beta):
    """Two epochs under the authors' momentum 0.9 and weight decay 1e-5, at the default
    coefficient 0.1 and at their CIFAR-100 value 0.05."""
    ctx = client()
    alg = build("feddecorr", ctx, *([] if beta is None else [f"feddecorr.beta={beta}"]))
    coef = 0.1 if beta is None else beta
    assert alg.settings.beta == coef
    glob = params_of(ctx, 2)
    state, _ = alg.local_init({"global": glob}, alg.init_client(params_of(ctx, 5), 0), ctx)
    new, upload, metrics = alg.local_train({"global": glob}, state, ctx)
    net = AuthorsNet(ctx.model, glob)
    batches = batch_pairs(ctx, "train", 2)
    assert len(batches) == 8
    losses = authors_local_training(net, batches, lr=0.05, momentum=0.9, weight_decay=1e-5, coef=coef)
    expected = {k: v.detach() for k, v in net.net.named_parameters()}
    # float32 over 8 steps; the near-constant feature columns amplify rounding (see above): measured
    # 1.8e-7 at most on parameters of 0.1-0.3, which the round moves by 0.01-0.13. Halving the
    # coefficient moves them by more than 4e-4 (checked below)
    for k in expected:
        torch.testing.assert_close(new["model"][k], expected[k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(upload["params"][k], expected[k], rtol=1e-5, atol=1e-6, msg=k)
    assert float(metrics["train_loss"]) == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    # half the coefficient ends elsewhere by far more than the tolerance
    half = AuthorsNet(ctx.model, glob)
    authors_local_training(half, batches, lr=0.05, momentum=0.9, weight_decay=1e-5, coef=coef / 2)
    assert min(float((a - b).detach().abs().max()) for a, b in zip(half.parameters(), net.parameters())) > 1e-4

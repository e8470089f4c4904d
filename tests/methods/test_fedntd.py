"""FedNTD: the not-true distillation by hand (docs/reference/methods/fedntd.md), and the loss and
client against my transcription of the authors' code: Lee-Gihun/FedNTD be00ee5,
``algorithms/fedntd/criterion.py`` (NTD_Loss), ``utils.py`` (refine_as_not_true),
``ClientTrainer.py``, ``BaseClientTrainer.py``, ``config/fedntd.json``."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms.fedntd import not_true_kl
from pflkit.functional.training import Batch
from tests.support.builders import batch_pairs, build, params_of, seeded_client, tiny_context
from tests.support.checks import ATOL, RTOL, assert_expected_close
from tests.support.references import module_at, sgd_reference, weights


def test_fedntd_distils_only_the_not_true_classes():
    s, t, y = torch.tensor([[2.0, 1.0, 0.0, -1.0]]), torch.tensor([[0.0, 3.0, 1.0, 0.5]]), torch.tensor([1])
    keep = torch.tensor([0, 2, 3])
    ps, pt = F.log_softmax(s[:, keep] / 2.0, 1), F.softmax(t[:, keep] / 2.0, 1)
    expected = 4 * float((pt * (pt.log() - ps)).sum())
    assert float(not_true_kl(s, t, y, tau=2.0)) == pytest.approx(expected, rel=1e-5)
    ctx = tiny_context()
    glob = params_of(ctx, 2)
    zero = build("fedntd", ctx, "fedntd.beta=0.0").local_train({"global": glob}, {"model": dict(glob)}, ctx)[0]
    torch.testing.assert_close(zero["model"], sgd_reference(ctx, glob, "train", 1))


# ============================================================================ the authors' code


def ntd_reference_loss(logits, targets, dg_logits, num_classes: int, tau: float, beta: float) -> torch.Tensor:
    """My transcription of Lee-Gihun/FedNTD criterion.py NTD_Loss.forward (be00ee5): CE(logits, y) +
    beta * tau^2 * KLDiv(batchmean)(log_softmax(not-true logits / tau), softmax(not-true global logits
    / tau)); the not-true logits are the C - 1 columns other than the target, in class order
    (utils.refine_as_not_true); the global model's side carries no gradient."""
    b = logits.shape[0]
    others = torch.arange(num_classes).expand(b, -1) != targets[:, None]
    student = logits[others].reshape(b, num_classes - 1)
    teacher = dg_logits.detach()[others].reshape(b, num_classes - 1)
    log_p = F.log_softmax(student / tau, dim=1)
    q = F.softmax(teacher / tau, dim=1)
    kl = (q * (q.log() - log_p)).sum() / b  # nn.KLDivLoss(reduction="batchmean")
    return F.cross_entropy(logits, targets) + beta * tau**2 * kl


def fedntd_reference_client(ctx, glob: dict, tau: float, beta: float) -> dict:
    """ClientTrainer.train: keep a frozen copy of the received model (no_grad logits), then per batch
    NTD loss, backward, optimizer step (torch.optim.SGD with the config's momentum / weight decay)."""
    model, dg_model = module_at(ctx.model, glob), module_at(ctx.model, glob)
    for p in dg_model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(
        model.parameters(), lr=ctx.train.lr, momentum=ctx.train.momentum, weight_decay=ctx.train.weight_decay
    )
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        opt.zero_grad()
        with torch.no_grad():
            dg_logits = dg_model(x)
        ntd_reference_loss(model(x), y, dg_logits, 10, tau, beta).backward()
        opt.step()
    return weights(model)


@pytest.mark.parametrize("overrides,tau,beta", [((), 1.0, 1.0), (("fedntd.tau=3.0", "fedntd.beta=0.3"), 3.0, 0.3)])
def test_fedntd_matches_the_authors_ntd_loss_and_client(overrides, tau, beta):
    from pflkit.algorithms.fedntd import fedntd_loss

    # FedNTD's config/fedntd.json: tau = beta = 1, SGD momentum 0.9, weight decay 1e-5 (pflkit's defaults: 1, 1)
    ctx = seeded_client(40, seed=3, lr=0.05, momentum=0.9, weight_decay=1e-5, epochs=2)
    alg = build("fedntd", ctx, *overrides)
    assert (alg.settings.tau, alg.settings.beta) == (tau, beta)
    glob, local = params_of(ctx, 2), params_of(ctx, 5)
    x, y = batch_pairs(ctx)[0]
    ours = fedntd_loss(beta, tau)(ctx.net, local, Batch(x, y), {"teacher": glob})
    theirs = ntd_reference_loss(module_at(ctx.model, local)(x), y, module_at(ctx.model, glob)(x), 10, tau, beta)
    torch.testing.assert_close(ours, theirs.detach(), rtol=RTOL, atol=ATOL)
    state, _ = alg.local_init({"global": glob}, alg.init_client(local, 0), ctx)
    new, upload, _ = alg.local_train({"global": glob}, state, ctx)
    expected = fedntd_reference_client(ctx, glob, tau, beta)
    assert_expected_close(new["model"], expected)
    assert_expected_close(upload["params"], expected)

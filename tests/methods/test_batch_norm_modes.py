"""Feature passes that measure rather than train run the body in evaluation mode: FedGH's uploaded
prototypes, FedPAC's feature statistics and prototypes, FedAS's alignment features. On a model with
batch norm (``fedbn_cnn``) they normalise with the running statistics, as the authors' ``eval()``
passes do, and leave those statistics unchanged; the other tests use a model without batch norm,
where the mode makes no difference."""

from __future__ import annotations

from functools import partial

import torch

from pflkit.algorithms.fedas import PROTOTYPES, alignment_loss
from pflkit.algorithms.fedpac import PROTOS, SEEN
from pflkit.functional.training import Batch, forward
from pflkit.models import build_model
from tests.support.builders import build, client_context

torch.set_num_threads(1)

CLASSES = [0, 2, 5, 7]


def bn_context(**train):
    """A client of 30 samples of four classes holding ``fedbn_cnn`` (five units before its head)."""
    torch.manual_seed(0)
    model = build_model("fedbn_cnn", (1, 8, 8), 10)
    return client_context(0, n_train=30, data_seed=3, classes=CLASSES, model=model, batch_size=10, **train)


def with_statistics(ctx, seed: int = 1) -> dict[str, torch.Tensor]:
    """``ctx``'s model with running statistics far from their initial 0 and 1 (so that the two
    modes differ)."""
    g = torch.Generator().manual_seed(seed)
    params = {k: v.detach().clone() for k, v in ctx.model.named_parameters()}
    for k, b in ctx.model.named_buffers():
        if b.is_floating_point():
            noise = torch.rand(b.shape, generator=g)
            params[k] = 0.5 + noise if k.endswith("running_var") else noise - 0.5
    return params


def features(ctx, params, train: bool) -> torch.Tensor:
    body = len(ctx.units) - 1
    copy = {k: v.clone() for k, v in params.items()}  # (a training-mode pass updates the statistics)
    return forward(ctx.model, copy, ctx.data.train_x, 0, body, train=train).flatten(1)


def class_means(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.stack([z[y == c].mean(0) for c in CLASSES])


def test_fedgh_uploads_prototypes_of_the_trained_body_in_evaluation_mode():
    ctx = bn_context(lr=0.05)
    alg = build("fedgh", ctx)
    init = with_statistics(ctx)
    payload = alg.downlink(alg.init_server(init), 0, 1)
    state, _ = alg.local_init(payload, alg.init_client(init, 0), ctx)
    new, upload, _ = alg.local_train(payload, state, ctx)
    y = ctx.data.train_y
    expected = class_means(features(ctx, new["model"], train=False), y)
    torch.testing.assert_close(upload["class_means"][CLASSES], expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(class_means(features(ctx, new["model"], train=True), y), expected, atol=1e-3)


def test_fedpac_measures_the_received_and_the_trained_body_in_evaluation_mode():
    ctx = bn_context(lr=0.05, local_epochs=1)
    alg = build("fedpac", ctx)
    received = with_statistics(ctx)
    payload = {"global": received, PROTOS: torch.zeros(10, 512), SEEN: torch.zeros(10, dtype=torch.bool)}
    state, _ = alg.local_init(payload, alg.init_client(with_statistics(ctx, 2), 0), ctx)
    new, upload, _ = alg.local_train(payload, state, ctx)
    y = ctx.data.train_y
    share = torch.tensor([float((y == c).sum()) / len(y) for c in CLASSES])
    rows = share[:, None] * class_means(features(ctx, state["model"], train=False), y)
    torch.testing.assert_close(upload["class_rows"][CLASSES], rows, rtol=1e-5, atol=1e-6)
    after = class_means(features(ctx, new["model"], train=False), y)
    torch.testing.assert_close(upload["class_means"][CLASSES], after, rtol=1e-5, atol=1e-6)


def test_fedas_aligns_features_taken_in_evaluation_mode_and_keeps_the_statistics():
    ctx = bn_context(lr=0.05)
    params = with_statistics(ctx)
    before = {k: v.clone() for k, v in params.items()}
    prototypes = torch.randn(10, 512, generator=torch.Generator().manual_seed(4))
    x, y = ctx.data.train_x[:10], ctx.data.train_y[:10]
    body = len(ctx.units) - 1
    value = alignment_loss(body)(partial(forward, ctx.model), params, Batch(x, y), {PROTOTYPES: prototypes})
    z = forward(ctx.model, dict(before), x, 0, body, train=False).flatten(1)
    expected = sum(((z[y == c] - prototypes[c]) ** 2).mean() for c in y.unique())
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    for k, v in before.items():
        assert torch.equal(params[k], v), k

"""FedNH: orthogonal prototypes, the learnable scale, clipping and the uniform server mean against a
computation by hand (docs/reference/methods/fednh.md), and the client round and server step against
my own transcriptions of the authors' code, with the settings their runs use (SGD momentum 0.9 and
weight decay, gradient clipping) and a prototype smoothing rho other than 0.5 (where rho and 1 - rho
are interchangeable).

Reference read (written from reading it, not copied): Yutong-Dai/FedNH 60c3161,
``src/flbase/strategies/FedUH.py`` (``FedUHClient.training``: SGD with momentum and weight decay
over the parameters that require gradients, ``clip_grad_norm_`` at 10 before every step),
``src/flbase/strategies/FedNH.py`` (``FedNHClient._estimate_prototype``, ``FedNHServer.aggregate``),
``src/flbase/models/CNN.py`` (``Conv2CifarNH``: logits = scaling * normalise(h) @ prototype^T with
the prototype frozen, the learnable scaling starting at 1), ``src/flbase/utils.py``
(``setup_optimizer``), ``experiments/gen_script.py`` (momentum 0.9; weight decay 1e-5 on CIFAR,
1e-3 on Tiny-ImageNet).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms import ClientSummary
from pflkit.algorithms.fednh import SCALE, spread_prototypes
from pflkit.engines import SingleClientContext
from pflkit.functional import forward
from tests.support.builders import batch_pairs, build, client_context, params_of, tiny_context


def reference_fednh_client(ctx, glob: dict, scale: float, lr: float, clip: float) -> tuple[dict, float]:
    """My transcription of the authors' FedNH client (Yutong-Dai/FedNH 60c3161, FedUH.py training
    loop with FedNH's model): logits = s * normalise(h) @ P^T with the prototypes P frozen, CE,
    backward into the body and s, clip_grad_norm_(body + s, clip), then an SGD step."""
    body_names = [k for k in glob if not k.startswith("fc.")]
    w = {k: v.detach().clone() for k, v in glob.items()}
    s = torch.tensor(scale)
    for x, y in batch_pairs(ctx, "train", 1):
        leaves = {k: w[k].clone().requires_grad_(True) for k in body_names}
        s_leaf = s.clone().requires_grad_(True)
        h = forward(ctx.model, {**w, **leaves}, x, train=True, stop=len(ctx.units) - 1).flatten(1)
        logits = s_leaf * (h / h.norm(dim=1, keepdim=True).clamp(min=1e-12)) @ w["fc.weight"].t()
        grads = torch.autograd.grad(F.cross_entropy(logits, y), [*leaves.values(), s_leaf])
        total = torch.sqrt(sum((g**2).sum() for g in grads))
        coef = min(1.0, clip / (float(total) + 1e-6))
        for (k, v), g in zip(leaves.items(), grads):
            w[k] = (v - lr * coef * g).detach()
        s = (s_leaf - lr * coef * grads[-1]).detach()
    return w, float(s)


def test_fednh_orthogonal_prototypes_learnable_scale_clipping_and_uniform_server_mean():
    P = spread_prototypes(10, 16, 300)  # the option prototype_init = "spread"
    cos = P @ P.t()
    assert torch.allclose(P.norm(dim=1), torch.ones(10), atol=1e-5) and (cos - torch.eye(10)).max() < 0.3
    ctx = tiny_context(n_train=30, lr=0.5)
    alg = build("fednh", ctx, "fednh.smoothing=0.5", "fednh.clip_norm=0.5")
    server = alg.init_server(params_of(ctx, 2))
    glob = server["global"]
    W = glob["fc.weight"]  # orthonormal rows (10 <= 64 features)
    torch.testing.assert_close(W @ W.t(), torch.eye(10), atol=1e-5, rtol=0)
    assert glob["fc.bias"].abs().sum() == 0 and float(server[SCALE]) == 1.0
    state, _ = alg.local_init(alg.downlink(server, 0, 1), alg.init_client(params_of(ctx, 5), 0), ctx)
    assert float(state[SCALE]) == 1.0 and torch.equal(state["model"]["fc.weight"], W)
    new, upload, _ = alg.local_train(alg.downlink(server, 0, 1), state, ctx)
    assert torch.equal(new["model"]["fc.weight"], W)  # prototypes frozen on clients
    expected, expected_scale = reference_fednh_client(ctx, glob, 1.0, lr=0.5, clip=0.5)
    torch.testing.assert_close(new["model"], expected, rtol=1e-4, atol=1e-6)
    assert float(upload["scale"]) == pytest.approx(expected_scale, rel=1e-5) and expected_scale != 1.0
    # the scored model's logits are the authors' s * normalise(h) @ P^T, so its test loss is theirs too
    scored = alg.eval_params(new)
    x, y = ctx.data.test_x, ctx.data.test_y
    h = forward(ctx.model, new["model"], x, stop=len(ctx.units) - 1).flatten(1)
    authors = new[SCALE] * (h / h.norm(dim=1, keepdim=True)) @ W.t()
    torch.testing.assert_close(forward(ctx.model, scored, x), authors, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(F.cross_entropy(forward(ctx.model, scored, x), y), F.cross_entropy(authors, y))
    assert torch.equal(scored["fc.weight"], W)  # the prototypes themselves are scored, not rescaled
    # server: uniform mean of the bodies and of s (not sample-weighted); prototypes smoothed where seen
    other = {
        **upload,
        "params": {k: v + 1.0 for k, v in upload["params"].items()},
        "num_samples": 90,
        "scale": torch.tensor(3.0),
        "client_id": 1,
    }
    out = alg.aggregate(server, [{**upload, "client_id": 0}, other], 1)
    merged = out["global"]
    body = [k for k in glob if not k.startswith("fc.")]
    for k in body:
        torch.testing.assert_close(merged[k], upload["params"][k] + 0.5)
    assert float(out[SCALE]) == pytest.approx((expected_scale + 3.0) / 2, rel=1e-6)
    counts = upload["class_counts"] + other["class_counts"]
    seen = counts > 0
    average = F.normalize(
        upload["class_counts"][:, None] * upload["class_means"] + other["class_counts"][:, None] * other["class_means"],
        dim=1,
    )
    smoothed = F.normalize(0.5 * W + 0.5 * average, dim=1)
    torch.testing.assert_close(merged["fc.weight"][seen], smoothed[seen])
    torch.testing.assert_close(merged["fc.weight"][~seen], W[~seen])
    weighted = build("fednh", ctx, "fednh.body_weights='samples'").aggregate(
        server, [{**upload, "client_id": 0}, other], 1
    )
    for k in body:
        torch.testing.assert_close(weighted["global"][k], upload["params"][k] + 0.75)


# ---- under the authors' optimiser and at rho other than one half ----------------------------


BODY = 3  # digits_cnn: conv1, conv2, fc1 form the body; fc holds the prototypes


def client(
    cid: int,
    classes: list[int],
    n_train: int = 40,
    lr: float = 0.1,
    momentum: float = 0.9,
    weight_decay: float = 1e-3,
    epochs: int = 2,
) -> SingleClientContext:
    """Client ``cid`` with labels from ``classes`` (data seed 900 + cid) and the digits CNN (seed 0)."""
    return client_context(
        cid,
        n_train=n_train,
        data_seed=900 + cid,
        classes=classes,
        algorithm="fednh",
        batch_size=10,
        local_epochs=epochs,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
    )


class AuthorsFedNHModel(nn.Module):
    """Conv2CifarNH's forward on the digits CNN's body: h = the body's output, normalised (norm
    clamped at 1e-12); logits = scaling * (h @ prototype^T), the frozen prototype used as it is."""

    def __init__(self, model: nn.Module, params: dict, scaling: float) -> None:
        super().__init__()
        self.body = copy.deepcopy(model)
        with torch.no_grad():
            for k, v in self.body.named_parameters():
                v.copy_(params[k])
        for k, v in self.body.named_parameters():
            v.requires_grad_(not k.startswith("fc."))  # the prototypes (and the unused bias) are frozen
        self.prototype = nn.Parameter(params["fc.weight"].clone(), requires_grad=False)
        self.scaling = nn.Parameter(torch.tensor([scaling]))

    def embedding(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x, stop=BODY).flatten(1)
        return h / torch.norm(h, p=2, dim=1, keepdim=True).clamp(min=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaling * torch.matmul(self.embedding(x), self.prototype.T)


def authors_training(
    net: AuthorsFedNHModel, batches, lr: float, momentum: float, weight_decay: float, max_norm: float
) -> list[float]:
    """FedUHClient.training: SGD over the parameters that require gradients; per batch CE,
    zero_grad, backward, clip_grad_norm_ of those parameters, step. Returns the gradient norms
    the clip saw."""
    trainable = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=lr, momentum=momentum, weight_decay=weight_decay)
    norms = []
    for x, y in batches:
        loss = F.cross_entropy(net(x), y)
        net.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(parameters=trainable, max_norm=max_norm)))
        opt.step()
    return norms


def authors_scaled_prototype(net: AuthorsFedNHModel, x: torch.Tensor, y: torch.Tensor, classes: int) -> torch.Tensor:
    """FedNHClient._estimate_prototype: per class the sum of the normalised embeddings (eval mode),
    divided by the class count, normalised, multiplied by the count (absent classes: 0)."""
    with torch.no_grad():
        emb = net.embedding(x)
    proto = torch.zeros(classes, emb.shape[1])
    for c in torch.unique(y).tolist():
        mask = y == c
        n = int(mask.sum())
        mean = emb[mask].sum(0) / n
        proto[c] = mean / torch.norm(mean).clamp(min=1e-12) * n
    return proto


def authors_server(
    server_params: dict, server_scale: float, uploads: list[tuple[dict, float, torch.Tensor, torch.Tensor]], rho: float
) -> tuple[dict, float, torch.Tensor]:
    """FedNHServer.aggregate with server learning rate 1 (their configs): every entry of the
    state dict (scaling included) moves by the mean of the clients' differences; cumsum_per_class
    adds count_by_class_full (1e-12 for an absent class); the average prototype sums
    scaled_prototype / cumsum, is normalised, and the prototype becomes
    normalise(rho * W + (1 - rho) * average)."""
    M = len(uploads)
    merged = {k: v + sum(p[k] - v for p, _, _, _ in uploads) / M for k, v in server_params.items() if k != "fc.weight"}
    scale = server_scale + sum(s - server_scale for _, s, _, _ in uploads) / M
    cumsum = sum(torch.where(counts > 0, counts, torch.full_like(counts, 1e-12)) for _, _, _, counts in uploads)
    average = sum(proto / cumsum.view(-1, 1) for _, _, proto, _ in uploads)
    average = F.normalize(average, dim=1)
    W = server_params["fc.weight"]
    return merged, scale, F.normalize(rho * W + (1 - rho) * average, dim=1)


# The authors' optimiser under their momentum and the Tiny-ImageNet weight decay; clip_norm 10 is
# theirs (inactive on this small problem), 0.8 engages on some steps and not on others
@pytest.mark.parametrize("clip", [10.0, 0.8])
def test_fednh_client_round_is_the_authors_training_under_momentum_weight_decay_and_clipping(clip):
    ctx = client(0, [0, 1, 2, 3, 5, 8])
    alg = build("fednh", ctx, f"fednh.clip_norm={clip}")
    server = alg.init_server(params_of(ctx, 2))
    glob = server["global"]
    payload = alg.downlink(server, 0, 1)
    state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 5), 0), ctx)
    new, upload, _ = alg.local_train(payload, state, ctx)

    net = AuthorsFedNHModel(ctx.model, glob, 1.0)
    norms = authors_training(net, batch_pairs(ctx, "train", 2), lr=0.1, momentum=0.9, weight_decay=1e-3, max_norm=clip)
    assert len(norms) == 8
    expected = {k: v.detach() for k, v in net.body.named_parameters()}
    # float32, the same operations in the same order (the clip coefficient as torch computes it):
    # measured at most a few float32 ulps apart; rtol is torch's float32 default
    for k in expected:
        torch.testing.assert_close(new["model"][k], expected[k], rtol=1.3e-6, atol=1e-7, msg=k)
        torch.testing.assert_close(upload["params"][k], expected[k], rtol=1.3e-6, atol=1e-7, msg=k)
    torch.testing.assert_close(new[SCALE], net.scaling.detach()[0], rtol=1.3e-6, atol=1e-7)
    torch.testing.assert_close(upload["scale"], net.scaling.detach()[0], rtol=1.3e-6, atol=1e-7)
    assert float(net.scaling.detach()) != 1.0 and torch.equal(new["model"]["fc.weight"], glob["fc.weight"])
    if clip < 1:
        assert min(norms) < clip < max(norms)  # the clip engaged on some steps only
    else:
        assert max(norms) < clip
    # the uploaded prototype estimate: count * normalised class mean, what the server sums
    scaled = authors_scaled_prototype(net, ctx.data.train_x, ctx.data.train_y, 10)
    ours = upload["class_counts"][:, None] * upload["class_means"]
    torch.testing.assert_close(ours, scaled, rtol=1.3e-6, atol=1e-6)


@pytest.mark.parametrize("rho", [0.9, 0.7])
def test_fednh_server_step_is_the_authors_aggregate_at_rho_other_than_one_half(rho):
    """Two clients with different classes (0, 4, 6, 7 and 9 seen by neither): uniform mean of the
    bodies and of s, prototypes smoothed towards the count-weighted average at rho (default 0.9,
    and 0.7)."""
    ctxs = [client(0, [0, 1, 2, 3, 5], n_train=30), client(1, [1, 3, 8], n_train=50)]
    alg = build("fednh", ctxs[0], f"fednh.smoothing={rho}")
    server = alg.init_server(params_of(ctxs[0], 2))
    server = {**server, SCALE: torch.tensor(1.5)}
    summaries = [ClientSummary(c.client_id, c.num_train, c.label_counts.numpy()) for c in ctxs]
    server = alg.prepare(server, summaries)
    uploads, theirs = [], []
    for ctx in ctxs:
        payload = alg.downlink(server, ctx.client_id, 1)
        state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 5), ctx.client_id), ctx)
        _, upload, _ = alg.local_train(payload, state, ctx)
        uploads.append({**upload, "client_id": ctx.client_id})
        counts = upload["class_counts"]
        theirs.append((upload["params"], float(upload["scale"]), counts[:, None] * upload["class_means"], counts))
    out = alg.aggregate(server, uploads, 1)
    merged, scale, prototypes = authors_server(server["global"], 1.5, theirs, rho)
    # float32 sums of two terms and two normalisations in another order: a few ulps
    for k in merged:
        torch.testing.assert_close(out["global"][k], merged[k], rtol=1.3e-6, atol=1e-7, msg=k)
    assert float(out[SCALE]) == pytest.approx(scale, rel=1e-6)
    torch.testing.assert_close(out["global"]["fc.weight"], prototypes, rtol=1.3e-6, atol=1e-7)
    seen = (uploads[0]["class_counts"] + uploads[1]["class_counts"]) > 0
    assert seen.sum() == 6
    W = server["global"]["fc.weight"]
    torch.testing.assert_close(out["global"]["fc.weight"][~seen], W[~seen])  # unseen: unchanged
    # rho matters: the moved rows are nowhere near those of 1 - rho
    _, _, swapped = authors_server(server["global"], 1.5, theirs, 1 - rho)
    assert float((swapped[seen] - out["global"]["fc.weight"][seen]).abs().max()) > 1e-2
    assert np.isclose(float(out["global"]["fc.weight"].norm(dim=1).min()), 1.0, atol=1e-5)

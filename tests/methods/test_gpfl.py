"""GPFL: the client, the server and the scored model against my transcription of the authors' code,
TsingZ0/GPFL ed7a7fe, ``system/flcore/clients/clientgp.py`` (train, set_GCE, test_metrics) and
``system/flcore/servers/servergp.py`` (GCE, CoV, global_GCE, global_CoV, receive_models)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms.gpfl import BRANCHES, COV
from tests.support.builders import batch_pairs, build, params_of, seeded_client, summaries
from tests.support.checks import RTOL, assert_expected_close
from tests.support.references import BODY, module_at, weights

D, C = 64, 10


class AuthorsGCE(nn.Module):
    """GCE: nn.Embedding(C, d); forward: CE of cosine logits F.linear(normalize(x), normalize(E))
    as -mean(sum(one_hot * log_softmax))."""

    def __init__(self, table):
        super().__init__()
        self.embedding = nn.Embedding(C, D)
        with torch.no_grad():
            self.embedding.weight.copy_(table)

    def forward(self, x, label):
        embeddings = self.embedding(torch.tensor(range(C)))
        cosine = F.linear(F.normalize(x), F.normalize(embeddings))
        one_hot = torch.zeros(cosine.size())
        one_hot.scatter_(1, label.view(-1, 1).long(), 1)
        return -torch.mean(torch.sum(one_hot * F.log_softmax(cosine, dim=1), dim=1))


class AuthorsCoV(nn.Module):
    """CoV: Conditional_gamma/beta = Sequential(Linear(d, d), ReLU, LayerNorm(d));
    forward(x, c) = ReLU(x * (gamma(c) + 1) + beta(c))."""

    def __init__(self, between):
        super().__init__()
        self.Conditional_gamma = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.LayerNorm([D]))
        self.Conditional_beta = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.LayerNorm([D]))
        self.act = nn.ReLU()
        with torch.no_grad():
            for b, seq in (("gamma", self.Conditional_gamma), ("beta", self.Conditional_beta)):
                seq[0].weight.copy_(between[COV.name(f"{b}.linear.weight")])
                seq[0].bias.copy_(between[COV.name(f"{b}.linear.bias")])
                seq[2].weight.copy_(between[COV.name(f"{b}.norm.weight")])
                seq[2].bias.copy_(between[COV.name(f"{b}.norm.bias")])

    def forward(self, x, context):
        gamma = self.Conditional_gamma(context)
        beta = self.Conditional_beta(context)
        return self.act(torch.add(torch.multiply(x, gamma + 1), beta))


def cov_entries(cov: AuthorsCoV) -> dict:
    out = {}
    for b, seq in (("gamma", cov.Conditional_gamma), ("beta", cov.Conditional_beta)):
        for layer, index in (("linear", 0), ("norm", 2)):
            out[COV.name(f"{b}.{layer}.weight")] = seq[index].weight.detach().clone()
            out[COV.name(f"{b}.{layer}.bias")] = seq[index].bias.detach().clone()
    return out


def shared_modules(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for b in BRANCHES:
        out[COV.name(f"{b}.linear.weight")] = 0.1 * torch.randn(D, D, generator=g)
        out[COV.name(f"{b}.linear.bias")] = 0.1 * torch.randn(D, generator=g)
        out[COV.name(f"{b}.norm.weight")] = 1 + 0.1 * torch.randn(D, generator=g)
        out[COV.name(f"{b}.norm.bias")] = 0.1 * torch.randn(D, generator=g)
    out[COV.name("gce")] = torch.randn(C, D, generator=g)
    return out


def authors_client(ctx, model_params, shared, personal_input, generic_input, lamda, mu):
    """clientGP.train after set_parameters/set_GCE/set_CoV: SGD on the model, SGD(weight_decay=mu)
    on GCE and CoV, all at lr; loss = CE(head(CoV(feat, p))) + GCE(CoV(feat, g), y)
    + lamda * torch.norm(CoV(feat, g) - GCE_frozen.embedding(y), 2); then set_GCE's inputs from the
    trained GCE: g = sum(emb / C), p = sum(emb * sample_per_class)."""
    model = module_at(ctx.model, model_params)
    gce, cov = AuthorsGCE(shared[COV.name("gce")]), AuthorsCoV(shared)
    frozen = AuthorsGCE(shared[COV.name("gce")])
    opt = torch.optim.SGD(model.parameters(), lr=ctx.train.lr)
    gce_opt = torch.optim.SGD(gce.parameters(), lr=ctx.train.lr, weight_decay=mu)
    cov_opt = torch.optim.SGD(cov.parameters(), lr=ctx.train.lr, weight_decay=mu)
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        feat = model(x, stop=BODY)
        output = model(cov(feat, personal_input), start=BODY)
        feat_g = cov(feat, generic_input)
        loss = nn.CrossEntropyLoss()(output, y) + gce(feat_g, y)
        emb = torch.zeros_like(feat)
        for i, yy in enumerate(y):
            emb[i, :] = frozen.embedding(yy).detach().data
        loss += torch.norm(feat_g - emb, 2) * lamda
        opt.zero_grad()
        gce_opt.zero_grad()
        cov_opt.zero_grad()
        loss.backward()
        opt.step()
        gce_opt.step()
        cov_opt.step()
    counts = torch.bincount(ctx.data.train_y, minlength=C).float()
    sample_per_class = counts / counts.sum()
    embeddings = gce.embedding(torch.tensor(range(C))).detach()
    generic, personal = torch.zeros(D), torch.zeros(D)
    for label, emb in enumerate(embeddings):
        generic += emb / C
        personal += emb * sample_per_class[label]
    trained = {**cov_entries(cov), COV.name("gce"): gce.embedding.weight.detach().clone()}
    return weights(model), trained, personal, generic


def pflkit_client(ctx, glob, shared, inputs, *overrides):
    alg = build("gpfl", ctx, *overrides)
    state = alg.init_client(params_of(ctx, 9), 0)
    state["between"] = {**state["between"], **inputs}
    payload = alg.downlink({"global": {**glob, **shared}}, 0, 2)
    state, _ = alg.local_init(payload, state, ctx)
    return alg, state, alg.local_train(payload, state, ctx)


@pytest.mark.parametrize("overrides,lamda,mu", [((), 0.01, 0.1), (("gpfl.lamda=0.5", "gpfl.mu=0.3"), 0.5, 0.3)])
def test_gpfl_client_is_the_authors_train(overrides, lamda, mu):
    ctx = seeded_client(40, seed=3, lr=0.05, epochs=2, round=2)
    glob, shared = params_of(ctx, 2), shared_modules(4)
    g = torch.Generator().manual_seed(5)
    p_in, g_in = torch.randn(D, generator=g), torch.randn(D, generator=g)
    inputs = {COV.name("personal_input"): p_in, COV.name("generic_input"): g_in}
    _, _, (new, upload, _) = pflkit_client(ctx, glob, shared, inputs, *overrides)
    start = {**glob, "fc.weight": params_of(ctx, 9)["fc.weight"], "fc.bias": params_of(ctx, 9)["fc.bias"]}
    model, trained, personal, generic = authors_client(ctx, start, shared, p_in, g_in, lamda, mu)
    assert_expected_close(new["model"], model)  # the body from the download, the head the client's own
    assert_expected_close(new["between"], trained)
    torch.testing.assert_close(new["between"][COV.name("personal_input")], personal, rtol=RTOL, atol=1e-5)
    torch.testing.assert_close(new["between"][COV.name("generic_input")], generic, rtol=RTOL, atol=1e-5)
    body = {k: v for k, v in model.items() if not k.startswith("fc.")}
    assert_expected_close(upload["params"], {**body, **trained})
    assert set(upload["params"]) == set(body) | set(trained)  # the head and the inputs stay
    # both alignments' weights matter here
    for other in ((0.0, mu), (lamda, 0.0)):
        changed, moved, *_ = authors_client(ctx, start, shared, p_in, g_in, *other)
        assert any(not torch.allclose(trained[k], moved[k], atol=1e-4) for k in trained) or any(
            not torch.allclose(model[k], changed[k], atol=1e-4) for k in model
        )


def test_gpfl_server_averages_body_cov_and_gce_and_scores_the_personal_path():
    """servergp: aggregate_parameters, global_GCE and global_CoV are sample-weighted averages
    (train_samples / total); the scored forward is test_metrics' head(CoV(feat, p))."""
    ctxs = [seeded_client(30, seed=1, client_id=0, lr=0.05), seeded_client(20, seed=2, client_id=1, lr=0.05)]
    glob = params_of(ctxs[0], 2)
    alg = build("gpfl", ctxs[0])
    server = alg.prepare(alg.init_server(glob), summaries([30, 20]), 0)
    uploads, states = [], []
    for i, ctx in enumerate(ctxs):
        payload = alg.downlink(server, i, 1)
        assert "fc.weight" not in payload["global"]  # the head is personal
        state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 5), i), ctx)
        new, upload, _ = alg.local_train(payload, state, ctx)
        states.append(new)
        uploads.append({**upload, "num_samples": int(upload["num_samples"]), "client_id": i})
    after = alg.aggregate(server, uploads, 1)
    expected = {k: 0.6 * uploads[0]["params"][k] + 0.4 * uploads[1]["params"][k] for k in uploads[0]["params"]}
    assert_expected_close(after["global"], expected)
    assert set(alg.global_params(after)) == set(glob)
    ctx, state = ctxs[0], states[0]
    model, cov = module_at(ctx.model, state["model"]), AuthorsCoV(state["between"])
    with torch.no_grad():
        theirs = model(cov(model(ctx.data.test_x, stop=BODY), state["between"][COV.name("personal_input")]), start=BODY)
    ours = ctx.net(alg.eval_params(state), ctx.data.test_x, train=False)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=1e-5)


@pytest.mark.integration
def test_gpfl_resumes_after_an_interruption_to_the_uninterrupted_numbers(tmp_path, fast_config):
    from pflkit.config import load_config
    from pflkit.run.experiment import resume_experiment, run_experiment
    from tests.support.runs import InterruptAfter, records_without_timings

    config = load_config(None, [*fast_config, 'algorithms=["gpfl"]', "rounds=4"])
    run_experiment(config, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):  # after round 2: the head and the conditional inputs must carry over
        run_experiment(
            config, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("gpfl", 2)]
        )
    resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    assert records_without_timings(tmp_path / "cut") == records_without_timings(tmp_path / "full")

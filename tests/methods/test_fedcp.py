"""FedCP: the client, the upload, the server and the scored model against my transcription of the
authors' code, TsingZ0/FedCP 7110e97, ``system/flcore/clients/clientcp.py`` (clientCP.train_cs_model,
generate_upload_head, set_head_g, MMD, Ensemble, Gate) and ``system/flcore/servers/servercp.py``
(ConditionalSelection, receive_models, aggregate_parameters, global_head, global_cs); PFLlib
d832e76's ``clientcp.py``/``servercp.py`` are the same code. F.gumbel_softmax draws its noise from
torch's global generator; the transcription takes pflkit's draws instead (``gumbels``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms.fedcp import CPN, gumbel_noise, mmd, open_unit
from tests.support.builders import batch_pairs, build, params_of, seeded_client, summaries
from tests.support.checks import ATOL, RTOL, assert_expected_close
from tests.support.references import BODY, module_at, weights

D, C = 64, 10


def authors_mmd(x, y):
    """MMD(x, y, 'rbf'): bandwidths [10, 15, 20, 50], XX += exp(-0.5 dxx / a), mean(XX + YY - 2 XY)."""
    xx, yy, zz = torch.mm(x, x.t()), torch.mm(y, y.t()), torch.mm(x, y.t())
    rx, ry = xx.diag().unsqueeze(0).expand_as(xx), yy.diag().unsqueeze(0).expand_as(yy)
    dxx, dyy, dxy = rx.t() + rx - 2.0 * xx, ry.t() + ry - 2.0 * yy, rx.t() + ry - 2.0 * zz
    XX, YY, XY = torch.zeros(xx.shape), torch.zeros(xx.shape), torch.zeros(xx.shape)
    for a in [10, 15, 20, 50]:
        XX += torch.exp(-0.5 * dxx / a)
        YY += torch.exp(-0.5 * dyy / a)
        XY += torch.exp(-0.5 * dxy / a)
    return torch.mean(XX + YY - 2.0 * XY)


class AuthorsCS(nn.Module):
    """ConditionalSelection(in_dim, in_dim): Linear(d, 2d), LayerNorm(2d), ReLU; view (b, 2, d);
    gumbel_softmax over dim 1 (here softmax((x + gumbels) / tau)); returns x[:, 0], x[:, 1]."""

    def __init__(self, between):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(D, 2 * D), nn.LayerNorm([2 * D]), nn.ReLU())
        with torch.no_grad():
            self.fc[0].weight.copy_(between[CPN.name("cpn.weight")])
            self.fc[0].bias.copy_(between[CPN.name("cpn.bias")])
            self.fc[1].weight.copy_(between[CPN.name("norm.weight")])
            self.fc[1].bias.copy_(between[CPN.name("norm.bias")])

    def forward(self, x, tau, gumbels):
        shape = x.shape
        x = self.fc(x).view(shape[0], 2, -1)
        x = torch.softmax((x + gumbels) / tau, dim=1)
        return x[:, 0, :], x[:, 1, :]


def authors_forward(model, cs, head_g, context, x, tau, gumbels):
    """Ensemble.forward (flag 0): rep = feature_extractor(x); gate_in = rep * normalize(context);
    rep_p, rep_g = rep * pm, rep * gm; output = model.head(rep_p) + head_g(rep_g)."""
    rep = model(x, stop=BODY)
    context = torch.tile(F.normalize(context[None], p=2, dim=1), (x.shape[0], 1))
    pm, gm = cs(rep * context, tau, gumbels)
    return model(rep * pm, start=BODY) + head_g(rep * gm), rep


def authors_client(ctx, glob, between, lamda, tau, key):
    """train_cs_model: one SGD (lr) over the Ensemble's parameters: the model (feature extractor and
    personal head) and the CPN; head_g and the feature_extractor copy are frozen. Per batch:
    CE(output) + MMD(rep, feature_extractor(x)) * lamda. Then generate_upload_head (head_g <- 0.5
    head + 0.5 head_g) and set_head_g's context: the column sums of the personal head's weight."""
    personal = {k: between[CPN.name("head." + k)] for k in ("fc.weight", "fc.bias")}
    model = module_at(ctx.model, {**glob, **personal})
    base = module_at(ctx.model, glob)
    head_g = nn.Linear(D, C)
    with torch.no_grad():
        head_g.weight.copy_(glob["fc.weight"])
        head_g.bias.copy_(glob["fc.bias"])
    for p in [*head_g.parameters(), *base.parameters()]:
        p.requires_grad_(False)
    cs = AuthorsCS(between)
    opt = torch.optim.SGD([*model.parameters(), *cs.parameters()], lr=ctx.train.lr)
    for step, (x, y) in enumerate(batch_pairs(ctx, "train", ctx.train.local_epochs)):
        gumbels = gumbel_noise(key + step, (x.shape[0], 2, D), x) if key is not None else 0.0
        output, rep = authors_forward(model, cs, head_g, between[CPN.name("context")], x, tau, gumbels)
        loss = F.cross_entropy(output, y) + authors_mmd(rep, base(x, stop=BODY)) * lamda
        opt.zero_grad()
        loss.backward()
        opt.step()
    upload_head = {k: 0.5 * getattr(model.fc, k[3:]).detach() + 0.5 * getattr(head_g, k[3:]) for k in personal}
    context = model.fc.weight.detach().sum(0)
    return weights(model), weights(cs.fc), upload_head, context


def client_between(glob, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        CPN.name("cpn.weight"): 0.1 * torch.randn(2 * D, D, generator=g),
        CPN.name("cpn.bias"): 0.1 * torch.randn(2 * D, generator=g),
        CPN.name("norm.weight"): 1 + 0.1 * torch.randn(2 * D, generator=g),
        CPN.name("norm.bias"): 0.1 * torch.randn(2 * D, generator=g),
        CPN.name("head.fc.weight"): glob["fc.weight"] + 0.2 * torch.randn(C, D, generator=g),
        CPN.name("head.fc.bias"): glob["fc.bias"] + 0.2 * torch.randn(C, generator=g),
        CPN.name("context"): torch.rand(D, generator=g),
    }


def pflkit_client(ctx, glob, between, *overrides):
    alg = build("fedcp", ctx, *overrides)
    shared = CPN.shared_entries(between)
    state = {"model": params_of(ctx, 9), "between": {**between, **{k: torch.zeros_like(v) for k, v in shared.items()}}}
    state["trained"] = torch.tensor(1.0)
    payload = alg.downlink({"global": {**glob, **shared}}, 0, 2)
    state, _ = alg.local_init(payload, state, ctx)
    return alg, state, alg.local_train(payload, state, ctx)


@pytest.mark.parametrize("overrides,lamda,tau", [((), 5.0, 1.0), (("fedcp.lamda=1.0", "fedcp.tau=0.5"), 1.0, 0.5)])
def test_fedcp_client_is_the_authors_train_cs_model(overrides, lamda, tau):
    ctx = seeded_client(40, seed=3, lr=0.05, epochs=2, round=2)
    glob, between = params_of(ctx, 2), client_between(params_of(ctx, 2), 4)
    _, _, (new, upload, _) = pflkit_client(ctx, glob, between, *overrides)
    key = torch.randint(0, 2**31 - 1, (), generator=ctx.generator("fedcp-noise"))
    model, cs, upload_head, context = authors_client(ctx, glob, between, lamda, tau, key)
    body = {k: v for k, v in model.items() if not k.startswith("fc.")}
    assert_expected_close(new["model"], body)
    assert_expected_close(new["model"], glob, keys=["fc.weight", "fc.bias"])  # head_g frozen
    assert_expected_close(new["between"], {CPN.name("head." + k): model[k] for k in ("fc.weight", "fc.bias")})
    cpn = {
        "cpn.weight": cs["0.weight"],
        "cpn.bias": cs["0.bias"],
        "norm.weight": cs["1.weight"],
        "norm.bias": cs["1.bias"],
    }
    assert_expected_close(new["between"], {CPN.name(k): v for k, v in cpn.items()})
    torch.testing.assert_close(new["between"][CPN.name("context")], context, rtol=RTOL, atol=ATOL)
    assert_expected_close(upload["params"], {**body, **upload_head, **{CPN.name(k): v for k, v in cpn.items()}})
    assert not any(k.startswith(CPN.name("head.")) or k == CPN.name("context") for k in upload["params"])
    # the noise and the MMD term matter here
    quiet, *_ = authors_client(ctx, glob, between, lamda, tau, None)
    plain, *_ = authors_client(ctx, glob, between, 0.0, tau, key)
    assert any(not torch.allclose(model[k], quiet[k], atol=1e-4) for k in body)
    assert any(not torch.allclose(model[k], plain[k], atol=1e-4) for k in body)


def test_fedcp_without_noise_option_is_the_plain_softmax():
    ctx = seeded_client(30, seed=5, lr=0.05, round=2)
    glob, between = params_of(ctx, 2), client_between(params_of(ctx, 2), 6)
    _, _, (new, _, _) = pflkit_client(ctx, glob, between, "fedcp.gumbel=false")
    model, *_ = authors_client(ctx, glob, between, 5.0, 1.0, None)
    assert_expected_close(new["model"], {k: v for k, v in model.items() if not k.startswith("fc.")})


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_fedcp_server_averages_body_cpn_and_uploaded_heads_and_scores_both_heads(tau):
    """servercp: aggregate_parameters, global_head and global_cs are sample-weighted averages
    (train_samples / total); the scored forward is Ensemble.forward (without noise) at the τ of
    training, the model's one ``tau``."""
    ctxs = [seeded_client(30, seed=1, client_id=0, lr=0.05), seeded_client(20, seed=2, client_id=1, lr=0.05)]
    glob = params_of(ctxs[0], 2)
    alg = build("fedcp", ctxs[0], f"fedcp.tau={tau}")
    server = alg.prepare(alg.init_server(glob), summaries([30, 20]), 0)
    uploads, states = [], []
    for i, ctx in enumerate(ctxs):
        payload = alg.downlink(server, i, 1)
        state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 5), i), ctx)
        assert state["between"][CPN.name("context")].abs().sum() > 0  # a random context before the first training
        new, upload, _ = alg.local_train(payload, state, ctx)
        states.append(new)
        uploads.append({**upload, "num_samples": int(upload["num_samples"]), "client_id": i})
    after = alg.aggregate(server, uploads, 1)
    expected = {k: 0.6 * uploads[0]["params"][k] + 0.4 * uploads[1]["params"][k] for k in uploads[0]["params"]}
    assert_expected_close(after["global"], expected)
    assert set(alg.global_params(after)) == set(glob)
    # the scored model
    ctx, state = ctxs[0], states[0]
    between = state["between"]
    model = module_at(
        ctx.model, {**state["model"], **{k: between[CPN.name("head." + k)] for k in ("fc.weight", "fc.bias")}}
    )
    head_g = nn.Linear(D, C)
    with torch.no_grad():
        head_g.weight.copy_(state["model"]["fc.weight"])
        head_g.bias.copy_(state["model"]["fc.bias"])
        theirs, _ = authors_forward(
            model, AuthorsCS(between), head_g, between[CPN.name("context")], ctx.data.test_x, tau, 0.0
        )
    ours = ctx.net(alg.eval_params(state), ctx.data.test_x, train=False)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


def test_fedcp_mmd_and_gumbel_noise():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g) + 1
    torch.testing.assert_close(mmd(x, y), authors_mmd(x, y))
    mask = torch.tensor([1.0] * 6 + [0.0] * 2)
    torch.testing.assert_close(mmd(x, y, mask), authors_mmd(x[:6], y[:6]))
    noise = gumbel_noise(torch.tensor(7), (200, 2, 50), x)
    assert float(noise.mean()) == pytest.approx(0.5772, abs=0.02)  # Euler's constant
    assert float(noise.var()) == pytest.approx(math.pi**2 / 6, rel=0.05)
    assert not torch.equal(noise, gumbel_noise(torch.tensor(8), (200, 2, 50), x))
    assert torch.equal(noise, gumbel_noise(torch.tensor(7), (200, 2, 50), x))
    # the extreme draws stay finite: a key whose draw held a 24-bit maximum gave +inf (a NaN loss
    # in the digits demo's round 46)
    assert torch.isfinite(gumbel_noise(torch.tensor(64114057), (10, 2, 512), x)).all()
    edges = open_unit(torch.tensor([0, 2**23 - 1]))
    assert 0 < float(edges[0]) and float(edges[1]) < 1
    assert torch.isfinite(-torch.log(-torch.log(edges))).all()


def test_fedcp_refuses_a_model_without_a_linear_head():
    from pflkit.models import build_model

    with pytest.raises(ValueError, match="linear head"):
        build("fedcp", seeded_client(10)).check_model(build_model("squeezenet1_1", (3, 32, 32), 10))


def test_fedcp_server_cpn_draw_follows_the_run_seed():
    ctx = seeded_client(10)
    alg = build("fedcp", ctx)
    glob = params_of(ctx, 1)
    a, b = (alg.prepare(alg.init_server(glob), summaries([10]), s)["global"] for s in (0, 1))
    name = CPN.name("cpn.weight")
    assert not torch.equal(a[name], b[name])
    assert float(a[name].abs().max()) <= D**-0.5


@pytest.mark.integration
def test_fedcp_resumes_after_an_interruption_to_the_uninterrupted_numbers(tmp_path, fast_config):
    from pflkit.config import load_config
    from pflkit.run.experiment import resume_experiment, run_experiment
    from tests.support.runs import InterruptAfter, records_without_timings

    config = load_config(None, [*fast_config, 'algorithms=["fedcp"]', "rounds=4"])
    run_experiment(config, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):  # after round 2: the client state of rounds 1-2 must carry over
        run_experiment(
            config, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedcp", 2)]
        )
    resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    records = records_without_timings(tmp_path / "cut")
    assert records == records_without_timings(tmp_path / "full")
    assert [r["round"] for r in records if "round" in r][-1] == 4


def test_the_received_body_leaves_the_clients_batch_norm_statistics_alone():
    """h_0 runs the received body (the authors' separate deepcopy): one training step updates the
    client's running statistics once, from its own body's forward."""
    from pflkit.algorithms import TrainSettings
    from pflkit.algorithms.fedcp import BASE, KEY, fedcp_loss
    from pflkit.config import load_config
    from pflkit.functional.training import Batch, net_of
    from pflkit.methods import build_algorithm
    from pflkit.models import build_model

    torch.manual_seed(0)
    model = build_model("fedbn_cnn", (1, 8, 8), 10)
    alg = build_algorithm("fedcp", load_config(None, []).algorithm_sections(), TrainSettings(), model.units())
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    init.update({k: b.detach().clone() for k, b in model.named_buffers() if b.is_floating_point()})
    state = alg.init_client(init, 0)
    received = {k: v + 0.1 for k, v in init.items() if k in alg.body_names}
    params = {**state["model"], **state["between"], **{BASE + k: v for k, v in received.items()}}
    params[KEY] = torch.zeros((), dtype=torch.long)
    x, y = torch.randn(10, 1, 8, 8), torch.randint(0, 10, (10,))
    expected = {k: v.clone() for k, v in init.items() if "running" in k}
    net_of(model)(expected | {k: v for k, v in init.items() if "running" not in k}, x, stop=alg.body)
    fedcp_loss(alg.body, alg.body_names, 5.0, 1.0, False)(net_of(model), params, Batch(x, y), None)
    for k in expected:
        torch.testing.assert_close(params[k], expected[k], msg=k)

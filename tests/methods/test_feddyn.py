"""FedDyn: the server rule by hand (Algorithm 1, h summed per participant), and rounds against my
transcriptions of the authors' code (alpemreacar/FedDyn 48a19fa, ``utils_methods.py`` train_FedDyn,
``utils_general.py`` train_feddyn_mdl) and of PFLlib f1e313a (``clientdyn.py``, ``serverdyn.py``)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.support.builders import batch_pairs, build, client_ctx, params_of, perturbed, summaries
from tests.support.checks import assert_params_close, moved
from tests.support.references import XFAIL_DIFFERS, flat, module_at, network, weights

SIZES = [20, 20, 20]  # equal sizes: the authors' per-client α_i = α N / (m n_i) is then α itself
PLAN = [[0, 1], [1, 2], [0, 2]]  # participants per round: m = 3 clients, |P| = 2


def vector(params: dict) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in params.values()])


def unflatten(vec: torch.Tensor, like: dict) -> dict:
    out, i = {}, 0
    for k, v in like.items():
        out[k] = vec[i : i + v.numel()].reshape(v.shape)
        i += v.numel()
    return out


def contexts(round: int, lr: float = 0.05):
    return [client_ctx(i, n_train=n, lr=lr, round=round, rounds=3) for i, n in enumerate(SIZES)]


def pflkit_rounds(alpha: float, glob: dict, *overrides: str, lr: float = 0.05) -> list[dict]:
    """pflkit's FedDyn over ``PLAN``: each round's server model."""
    alg = build("feddyn", contexts(1)[0], f"feddyn.alpha={alpha}", *overrides)
    server = alg.prepare(alg.init_server(glob), summaries(SIZES))
    states = {i: alg.init_client(glob, i) for i in range(len(SIZES))}
    out = []
    for round, chosen in enumerate(PLAN, start=1):
        ctxs, uploads = contexts(round, lr), []
        for i in chosen:
            payload = alg.downlink(server, i, round)
            state, _ = alg.local_init(payload, states[i], ctxs[i])
            states[i], upload, _ = alg.local_train(payload, state, ctxs[i])
            uploads.append({**upload, "client_id": i})
        server = alg.aggregate(server, uploads, round)
        out.append(dict(server["global"]))
    return out


# ============================================================================ the authors' code
CLIPPED: list[bool] = []  # whether each step of the latest ``authors_rounds`` had its gradient clipped


def authors_train_feddyn_mdl(
    ctx, cloud: dict, alpha: float, local_grad: torch.Tensor, max_norm: float | None = 10.0, decay_in_loss=False
) -> dict:
    """train_feddyn_mdl: SGD(lr, weight_decay = α) from the cloud model; per batch CE (sum / batch size)
    + α Σ θ·(−θ_cloud + local_grad_vector), backward, gradient norm clipped at ``max_norm`` (the
    authors' 10; None: not clipped), step (which adds the weight decay α θ after the clipping).
    ``decay_in_loss``: not theirs, α/2 ‖θ‖² in the loss instead, so that the clipping scales α θ too."""
    net = module_at(ctx.model, cloud)
    opt = torch.optim.SGD(net.parameters(), lr=ctx.train.lr, weight_decay=0.0 if decay_in_loss else alpha)
    cloud_vec = vector(cloud)
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        loss_f = F.cross_entropy(net(x), y, reduction="sum") / y.shape[0]
        loss_algo = alpha * torch.sum(flat(net) * (-cloud_vec + local_grad))
        if decay_in_loss:
            loss_algo = loss_algo + alpha / 2 * torch.sum(flat(net) ** 2)
        opt.zero_grad()
        (loss_f + loss_algo).backward()
        if max_norm is not None:
            CLIPPED.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=max_norm)) > max_norm)
        opt.step()
    return weights(net)


def authors_rounds(
    alpha: float, glob: dict, max_norm: float | None = 10.0, lr: float = 0.05, decay_in_loss: bool = False
) -> list[dict]:
    """train_FedDyn: local_param_list[i] accumulates θ_i − θ_cloud; θ_cloud = mean of the selected
    clients' models + mean over all clients of local_param_list."""
    m = len(SIZES)
    local_param = torch.zeros(m, vector(glob).numel())
    client_params = vector(glob).repeat(m, 1)
    cloud, out = dict(glob), []
    CLIPPED.clear()
    for round, chosen in enumerate(PLAN, start=1):
        ctxs = contexts(round, lr)
        cloud_vec = vector(cloud)
        for i in chosen:
            trained = vector(authors_train_feddyn_mdl(ctxs[i], cloud, alpha, local_param[i], max_norm, decay_in_loss))
            local_param[i] += trained - cloud_vec
            client_params[i] = trained
        cloud = unflatten(client_params[chosen].mean(0) + local_param.mean(0), glob)
        out.append(cloud)
    return out


def test_feddyn_rounds_match_the_authors_train_feddyn():
    glob = params_of(contexts(1)[0], 2)
    alpha = 0.1  # large enough that the regulariser changes the result far beyond the tolerance
    ours, theirs = pflkit_rounds(alpha, glob), authors_rounds(alpha, glob)
    for a, b in zip(ours, theirs):
        assert_params_close(a, b)
    assert moved(theirs[-1], authors_rounds(1e-6, glob)[-1])  # the regulariser and h matter here


def test_feddyn_clipped_rounds_match_the_authors_train_feddyn():
    """At lr 0.5 with the norm capped at 1, the authors' clipping binds on some steps and not on others:
    pflkit's rounds follow theirs, and neither an unclipped run, nor one clipped at another norm, nor
    one clipping α θ with the rest of the gradient does."""
    glob = params_of(contexts(1)[0], 2)
    alpha, lr = 0.1, 0.5
    theirs = authors_rounds(alpha, glob, 1.0, lr)
    assert any(CLIPPED) and not all(CLIPPED)
    ours = pflkit_rounds(alpha, glob, "feddyn.max_grad_norm=1.0", lr=lr)
    for a, b in zip(ours, theirs):
        assert_params_close(a, b)
    assert moved(theirs[-1], authors_rounds(alpha, glob, None, lr)[-1])
    assert moved(theirs[-1], authors_rounds(alpha, glob, 1.2, lr)[-1])
    assert moved(theirs[-1], pflkit_rounds(alpha, glob, "feddyn.max_grad_norm=0", lr=lr)[-1])
    assert moved(theirs[-1], authors_rounds(alpha, glob, 1.0, lr, decay_in_loss=True)[-1])


# ============================================================================ Algorithm 1 by hand
def test_feddyn_server_is_algorithm_1():
    ctx = contexts(1)[0]
    glob = params_of(ctx, 2)
    alpha = 0.3
    alg = build("feddyn", ctx, f"feddyn.alpha={alpha}")
    server = alg.prepare(alg.init_server(glob), summaries([10, 30, 20, 40]))  # m = 4
    h = {k: torch.zeros_like(v) for k, v in glob.items()}
    theta = glob
    for round in (1, 2):
        models = [perturbed(theta, 10 * round + i, 0.1) for i in range(3)]
        uploads = [
            {"params": p, "num_samples": n, "client_id": i} for i, (p, n) in enumerate(zip(models, [10, 30, 20]))
        ]
        server = alg.aggregate(server, uploads, round)
        h = {k: h[k] - alpha / 4 * sum(p[k] - theta[k] for p in models) for k in h}
        theta = {k: sum(p[k] for p in models) / 3 - h[k] / alpha for k in h}  # unweighted, as Algorithm 1
        assert_params_close(server["global"], theta)
        assert_params_close(server["feddyn_h"], h)


def test_feddyn_client_state_is_the_gradient_update():
    ctx = contexts(1)[0]
    glob, alpha = params_of(ctx, 2), 0.2
    alg = build("feddyn", ctx, f"feddyn.alpha={alpha}")
    state = {**alg.init_client(glob, 0), "grad": perturbed({k: torch.zeros_like(v) for k, v in glob.items()}, 1, 0.01)}
    state, _ = alg.local_init({"global": glob}, state, ctx)
    new, _, _ = alg.local_train({"global": glob}, state, ctx)
    for k in glob:
        torch.testing.assert_close(new["grad"][k], state["grad"][k] - alpha * (new["model"][k] - glob[k]))


def test_feddyn_reports_the_objective_it_minimises_as_its_training_loss():
    """``train_loss`` is the mean over the steps of CE − ⟨g, θ⟩ + α/2 ‖θ − θ_cloud‖² before each step:
    the objective train_feddyn_mdl minimises, its quadratic part through SGD's weight decay α."""
    ctx = contexts(1)[0]
    glob, alpha = params_of(ctx, 2), 0.2
    alg = build("feddyn", ctx, f"feddyn.alpha={alpha}")
    grad = perturbed({k: torch.zeros_like(v) for k, v in glob.items()}, 1, 0.05)
    state, _ = alg.local_init({"global": glob}, {**alg.init_client(glob, 0), "grad": grad}, ctx)
    _, _, metrics = alg.local_train({"global": glob}, state, ctx)
    g, cloud = vector(grad), vector(glob)
    net = module_at(ctx.model, glob)
    opt = torch.optim.SGD(net.parameters(), lr=ctx.train.lr, weight_decay=alpha)
    values = []
    for x, y in batch_pairs(ctx, "train", ctx.train.local_epochs):
        theta = flat(net)
        ce = F.cross_entropy(net(x), y)
        values.append(float((ce - torch.dot(g, theta) + alpha / 2 * torch.sum((theta - cloud) ** 2)).detach()))
        opt.zero_grad()
        (ce + alpha * torch.sum(theta * (-cloud - g / alpha))).backward()  # local_grad = −g / α
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=10.0)
        opt.step()
    assert len(values) > 1 and metrics["train_loss"] == pytest.approx(sum(values) / len(values), rel=1e-5)


def test_feddyn_refuses_a_server_state_without_its_entries():
    ctx = contexts(1)[0]
    glob = params_of(ctx, 2)
    alg = build("feddyn", ctx)
    with pytest.raises(ValueError, match="feddyn"):
        alg.aggregate({"global": glob}, [{"params": glob, "num_samples": 1, "client_id": 0}], 1)


# ============================================================================ PFLlib f1e313a
def pfllib_rounds(alpha: float, glob: dict, squared: bool) -> list[dict]:
    """clientDyn.train: plain SGD on CE + α/2 ‖v − v_global‖ − v·old_grad (``torch.norm``, not squared;
    ``squared``: its square instead), then old_grad −= α (v − v_global). FedDyn server:
    update_server_state (state −= α Σ(θ_i − θ)/num_clients), aggregate_parameters (Σ θ_i / join_clients
    − state/α)."""
    m = len(SIZES)
    old_grad = [torch.zeros(vector(glob).numel()) for _ in range(m)]
    state = {k: torch.zeros_like(v) for k, v in glob.items()}
    theta, out = dict(glob), []
    for round, chosen in enumerate(PLAN, start=1):
        ctxs, uploaded = contexts(round), []
        g = vector(theta)
        for i in chosen:
            net = network(ctxs[i], theta)
            opt = torch.optim.SGD(net.parameters(), lr=ctxs[i].train.lr)
            for x, y in batch_pairs(ctxs[i], "train", 1):
                opt.zero_grad()
                v1 = flat(net)
                reg = torch.sum((v1 - g) ** 2) if squared else torch.norm(v1 - g, 2)
                loss = F.cross_entropy(net(x), y) + alpha / 2 * reg - torch.dot(v1, old_grad[i])
                loss.backward()
                opt.step()
            old_grad[i] = old_grad[i] - alpha * (flat(net).detach() - g)
            uploaded.append(weights(net))
        state = {k: state[k] - alpha * sum((u[k] - theta[k]) / m for u in uploaded) for k in state}
        theta = {k: sum(u[k] / len(chosen) for u in uploaded) - (1 / alpha) * state[k] for k in state}
        out.append(theta)
    return out


def test_feddyn_matches_pfllib_with_a_squared_regulariser():
    glob = params_of(contexts(1)[0], 2)
    for a, b in zip(pflkit_rounds(0.1, glob), pfllib_rounds(0.1, glob, squared=True)):
        assert_params_close(a, b)


@XFAIL_DIFFERS(reason="PFLlib's regulariser is α/2 ‖θ − θ_global‖, the norm unsquared")
def test_pfllib_feddyn_differs_by_its_unsquared_regulariser():
    glob = params_of(contexts(1)[0], 2)
    for a, b in zip(pflkit_rounds(0.1, glob), pfllib_rounds(0.1, glob, squared=False)):
        assert_params_close(a, b)


def test_feddyn_clips_per_client_on_the_batched_engine_as_on_the_loop():
    """Clients of 7 to 60 samples at a norm of 0.5 that binds on some steps: the vmap engine, which
    trains them together, clips each client's own gradient, as the loop engine does one by one."""
    from pflkit.engines import LoopEngine, VmapEngine
    from tests.support.builders import make_data, run_rounds
    from tests.support.checks import assert_states_close

    data = make_data([30, 45, 12, 60, 7])
    clipped = ["feddyn.max_grad_norm=0.5"]
    loop = run_rounds("feddyn", LoopEngine(), data, overrides=clipped)
    assert_states_close(loop, run_rounds("feddyn", VmapEngine(chunk_size=64), data, overrides=clipped), 1e-5)
    free = run_rounds("feddyn", LoopEngine(), data, overrides=["feddyn.max_grad_norm=0"])
    assert moved(loop.server["global"], free.server["global"])

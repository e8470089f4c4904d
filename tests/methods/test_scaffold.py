"""SCAFFOLD: the corrected step, option II and the server rule by themselves, and against my
transcription of PFLlib (``system/flcore/clients/clientscaffold.py``,
``system/flcore/servers/serverscaffold.py``, ``optimizers/fedoptimizer.py``: SCAFFOLDOptimizer) at
its first SCAFFOLD commit 495f8b4 and at d832e76 (the latest, which follows Algorithm 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms.scaffold import CONTROL, CONTROL_DELTA, CONTROL_NORM, NUM_CLIENTS
from pflkit.functional import NonFiniteLossError, forward
from tests.support.builders import (
    batch_pairs,
    build,
    client_context,
    make_data,
    params_of,
    perturbed,
    setup_for,
    simulate_rounds,
    summaries,
)
from tests.support.checks import assert_expected_close, moved
from tests.support.references import XFAIL_DIFFERS, network, pfllib_fedavg_client, weights

BATCH, LR = 10, 0.05


def client(cid: int, n: int, round: int = 1, epochs: int = 2, lr: float = LR, **train):
    """Client ``cid`` of ``n`` random samples (data seed ``cid``), batches of 10, lr 0.05, in round ``round``."""
    return client_context(
        cid, n_train=n, data_seed=cid, round=round, batch_size=BATCH, local_epochs=epochs, lr=lr, **train
    )


def zeros_like(params: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in params.items()}


# ============================================================================ PFLlib, transcribed


class PfllibScaffold:
    """My transcription of PFLlib's SCAFFOLD at ``commit`` ("495f8b4" or "d832e76").

    Client: ``set_parameters`` copies the global model into the client's module and keeps references
    to the server's model and c; ``train`` runs E epochs over the loader, each batch zero_grad,
    CrossEntropyLoss, backward and SCAFFOLDOptimizer.step: p ← p − lr (grad + c − c_i); then
    num_batches = len(loader) and ``update_yc``: c_i ← c_i − c + (x − y) / (num_batches · lr), where
    d832e76 divides by E as well; ``delta_yc``: Δy = y − x, Δc = −c + (x − y) / (the same).
    Server ``aggregate_parameters``: 495f8b4 adds Σ_i w_i Δy_i η_g (w_i = n_i / Σ n) to x and
    Σ_i Δc_i · |S| / N to c; d832e76 adds Σ_i Δy_i / |S| · η_g and Σ_i Δc_i / N.
    The loader here yields pflkit's batches of the client (``batch_pairs``)."""

    def __init__(self, commit: str, glob: dict, num_clients: int, server_lr: float = 1.0, lr: float = LR) -> None:
        assert commit in ("495f8b4", "d832e76")
        self.commit, self.x, self.N, self.eta_g, self.lr = commit, dict(glob), num_clients, server_lr, lr
        self.c = zeros_like(glob)
        self.client_c: dict[int, dict] = {}
        self.mean_gradients: dict[int, dict] = {}  # the mean raw gradient along each client's path

    def train(self, ctx, epochs: int, num_batches: int | None = None) -> tuple[dict, dict, dict]:
        """One client's round: (y, Δy, Δc); its c_i is updated in place. ``num_batches``: the loader's
        length (default: the client's batches per epoch)."""
        c_i = self.client_c.setdefault(ctx.client_id, zeros_like(self.x))
        net = network(ctx, self.x)
        batches = batch_pairs(ctx, "train", epochs)
        sums = zeros_like(self.x)
        for x, y in batches:
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
            with torch.no_grad():
                for k, p in net.named_parameters():
                    sums[k] += p.grad
                    p.add_(p.grad + self.c[k] - c_i[k], alpha=-self.lr)
        self.mean_gradients[ctx.client_id] = {k: v / len(batches) for k, v in sums.items()}
        y = weights(net)
        steps = (len(batches) // epochs if num_batches is None else num_batches) * (
            epochs if self.commit == "d832e76" else 1
        )
        delta_c = {k: -self.c[k] + 1 / steps / self.lr * (self.x[k] - y[k]) for k in y}
        for k in c_i:
            c_i[k] = c_i[k] + delta_c[k]
        return y, {k: y[k] - self.x[k] for k in y}, delta_c

    def aggregate(self, results: list[tuple[dict, dict, int]]) -> None:
        """``results``: (Δy, Δc, n) of each client that trained."""
        x, c = {k: v.clone() for k, v in self.x.items()}, {k: v.clone() for k, v in self.c.items()}
        total, joined = sum(n for _, _, n in results), len(results)
        for dy, dc, n in results:
            w = n / total if self.commit == "495f8b4" else 1 / joined
            for k in x:
                x[k] += dy[k].clone() * w * self.eta_g
            for k in c:
                c[k] += dc[k].clone() * joined / self.N if self.commit == "495f8b4" else dc[k].clone() / self.N
        self.x, self.c = x, c


def pflkit_round(alg, server: dict, states: dict, ctxs: list) -> tuple[dict, list]:
    """pflkit's round on ``ctxs`` (the sampled clients): downlink, local_init, local_train,
    aggregate; ``states`` (client id -> state) updated. Returns (new server, uploads)."""
    uploads = []
    for ctx in ctxs:
        payload = alg.downlink(server, ctx.client_id, ctx.round)
        state, _ = alg.local_init(payload, states[ctx.client_id], ctx)
        states[ctx.client_id], upload, metrics = alg.local_train(payload, state, ctx)
        sent = {"num_samples": int(upload["num_samples"]), "client_id": ctx.client_id}
        uploads.append({**upload, **sent, "local_steps": int(metrics["local_steps"])})
    return alg.aggregate(server, uploads, ctxs[0].round), uploads


def assert_finite(params: dict) -> None:
    assert all(torch.isfinite(v).all() for v in params.values())


# ============================================================================ by itself


def test_scaffold_with_zero_control_variates_trains_as_fedavg_and_sets_c_i_to_the_mean_gradient():
    ctx = client(0, 30, epochs=2)
    glob = params_of(ctx, 2)
    alg = build("scaffold", ctx)
    server = alg.prepare(alg.init_server(glob), summaries([30, 20, 50]))
    assert server[NUM_CLIENTS] == 3 and all(not v.any() for v in server[CONTROL].values())
    payload = alg.downlink(server, 0, 1)
    state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 7), 0), ctx)
    new, upload, metrics = alg.local_train(payload, state, ctx)
    assert int(metrics["local_steps"]) == 6  # 3 batches, 2 epochs
    assert_expected_close(new["model"], pfllib_fedavg_client(ctx, glob, lr=LR))
    # option II: (x - y) / (K lr) with K = 6 is the mean of the six mini-batch gradients
    reference = PfllibScaffold("d832e76", glob, 3)
    reference.train(ctx, 2)
    assert_expected_close(new[CONTROL], reference.mean_gradients[0])
    assert_expected_close(upload[CONTROL_DELTA], new[CONTROL])  # c_i was 0


def test_the_step_adds_c_minus_c_i_to_the_gradient_and_the_server_divides_the_sum_of_delta_c_by_n():
    ctx = client(0, 30, epochs=1)
    glob = params_of(ctx, 2)
    alg = build("scaffold", ctx)
    server = alg.prepare(alg.init_server(glob), summaries([30, 20, 50, 10]))
    server = {**server, CONTROL: perturbed(zeros_like(glob), 1, 0.5)}
    c_i = perturbed(zeros_like(glob), 2, 0.5)
    payload = alg.downlink(server, 0, 1)
    state, _ = alg.local_init(payload, {**alg.init_client(glob, 0), CONTROL: c_i}, ctx)
    new, upload, _ = alg.local_train(payload, state, ctx)
    y = {k: v.clone() for k, v in glob.items()}
    for x_, y_ in batch_pairs(ctx, "train", 1):  # y <- y - lr (g(y) - c_i + c), by hand
        leaves = {k: v.requires_grad_(True) for k, v in y.items()}
        g = torch.autograd.grad(F.cross_entropy(forward(ctx.model, leaves, x_), y_), list(leaves.values()))
        y = {k: (v - LR * (gk - c_i[k] + server[CONTROL][k])).detach() for (k, v), gk in zip(leaves.items(), g)}
    assert_expected_close(new["model"], y)
    expected_c_i = {k: c_i[k] - server[CONTROL][k] + (glob[k] - y[k]) / (3 * LR) for k in y}
    assert_expected_close(new[CONTROL], expected_c_i)
    assert moved(new["model"], pfllib_fedavg_client(ctx, glob, lr=LR))  # the correction matters
    other = {
        "params": perturbed(glob, 3, 0.1),
        "num_samples": 90,
        CONTROL_DELTA: perturbed(zeros_like(glob), 4, 1.0),
        "client_id": 2,
    }
    out = alg.aggregate(server, [{**upload, "client_id": 0}, other], 1)
    for k in glob:  # x + mean(y - x) (uniform), c + (dc_0 + dc_2) / 4
        torch.testing.assert_close(out["global"][k], (new["model"][k] + other["params"][k]) / 2)
        torch.testing.assert_close(
            out[CONTROL][k], server[CONTROL][k] + (upload[CONTROL_DELTA][k] + other[CONTROL_DELTA][k]) / 4
        )


def test_momentum_and_weight_decay_apply_to_the_corrected_gradient():
    ctx = client(0, 30, epochs=1, momentum=0.9, weight_decay=0.01)
    glob = params_of(ctx, 2)
    alg = build("scaffold", ctx)
    server = {**alg.prepare(alg.init_server(glob), summaries([30, 30])), CONTROL: perturbed(zeros_like(glob), 1, 0.5)}
    c_i = perturbed(zeros_like(glob), 2, 0.5)
    payload = alg.downlink(server, 0, 1)
    state, _ = alg.local_init(payload, {**alg.init_client(glob, 0), CONTROL: c_i}, ctx)
    new, _, _ = alg.local_train(payload, state, ctx)
    net = network(ctx, glob)  # torch.optim.SGD on grad + c - c_i
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9, weight_decay=0.01)
    for x, y in batch_pairs(ctx, "train", 1):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for k, p in net.named_parameters():
                p.grad += server[CONTROL][k] - c_i[k]
        opt.step()
    assert_expected_close(new["model"], weights(net))


def test_scaffold_ala_takes_c_i_from_the_start_ala_gives():
    ctx = client(0, 30, round=2, epochs=1)
    glob = params_of(ctx, 2)
    alg = build("scaffold+ala", ctx, "fedala.max_start_epochs=2")
    server = alg.prepare(alg.init_server(glob), summaries([30, 30]))
    payload = alg.downlink(server, 0, 2)
    state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 7), 0), ctx)
    assert moved(state["model"], glob)  # ALA blended the received model with the local one
    new, upload, metrics = alg.local_train(payload, state, ctx)
    expected = {k: (state["model"][k] - new["model"][k]) / (3 * LR) for k in new[CONTROL]}
    assert_expected_close(new[CONTROL], expected)
    assert_finite(upload[CONTROL_DELTA])


# ============================================================================ against PFLlib


def test_scaffold_matches_pfllib_over_rounds_of_unequal_clients_and_partial_participation():
    """Four clients of 4 to 140 samples (K = 2 to 28 steps over two epochs), two sampled a round:
    after every round x, c and every c_i equal PFLlib d832e76's; c stays the mean of all N c_i's; each
    c_i is the mean gradient along the client's last path; nothing is NaN."""
    sizes, rounds = [4, 25, 60, 140], [[0, 3], [1, 2], [0, 2], [3, 1]]
    glob = params_of(client(0, 4), 2)
    alg = build("scaffold", client(0, 4))
    server = alg.prepare(alg.init_server(glob), summaries(sizes))
    states = {i: alg.init_client(glob, i) for i in range(len(sizes))}
    reference = PfllibScaffold("d832e76", glob, len(sizes))
    for t, sampled in enumerate(rounds, start=1):
        ctxs = [client(i, sizes[i], round=t) for i in sampled]
        server, uploads = pflkit_round(alg, server, states, ctxs)
        results = []
        for ctx in ctxs:
            _, dy, dc = reference.train(ctx, 2)
            results.append((dy, dc, ctx.num_train))
        reference.aggregate(results)
        assert [u["local_steps"] for u in uploads] == [2 * max(1, sizes[i] // BATCH) for i in sampled]
        assert_expected_close(server["global"], reference.x)
        assert_expected_close(server[CONTROL], reference.c)
        for i in sampled:
            assert_expected_close(states[i][CONTROL], reference.client_c[i])
            assert_expected_close(states[i][CONTROL], reference.mean_gradients[i])
        mean_c_i = {k: sum(s[CONTROL][k] for s in states.values()) / len(sizes) for k in glob}
        assert_expected_close(server[CONTROL], mean_c_i)
        for part in (server["global"], server[CONTROL], *(s[CONTROL] for s in states.values())):
            assert_finite(part)
    assert moved(server[CONTROL], zeros_like(glob))


def test_scaffold_with_sample_weights_is_pfllib_495f8b4_for_one_epoch():
    """495f8b4 with E = 1 (its K, the batches of one epoch, is then the client's steps) from non-zero
    c and c_i: the client's y and c_i, and x averaged by training-set size."""
    glob = params_of(client(0, 30), 2)
    alg = build("scaffold", client(0, 30, epochs=1), 'scaffold.model_weights="samples"', "scaffold.server_lr=0.5")
    reference = PfllibScaffold("495f8b4", glob, 3, server_lr=0.5)
    server = alg.prepare(alg.init_server(glob), summaries([30, 50, 20]))
    server = {**server, CONTROL: perturbed(zeros_like(glob), 1, 0.2)}
    reference.c = {k: v.clone() for k, v in server[CONTROL].items()}
    states = {}
    for i in range(3):
        c_i = perturbed(zeros_like(glob), 10 + i, 0.2)
        states[i] = {**alg.init_client(glob, i), CONTROL: c_i}
        reference.client_c[i] = {k: v.clone() for k, v in c_i.items()}
    ctxs = [client(0, 30, epochs=1), client(1, 50, epochs=1)]
    server, _ = pflkit_round(alg, server, states, ctxs)
    reference.aggregate([(*reference.train(ctx, 1)[1:], ctx.num_train) for ctx in ctxs])
    for ctx in ctxs:
        assert_expected_close(states[ctx.client_id][CONTROL], reference.client_c[ctx.client_id])
    assert_expected_close(server["global"], reference.x)


@XFAIL_DIFFERS(reason="495f8b4 adds |S|/N times the sum of the Δc to c, not |S|/N times their mean")
def test_pfllib_495f8b4_updates_c_by_the_sum_not_the_mean():
    glob = params_of(client(0, 30), 2)
    alg = build("scaffold", client(0, 30, epochs=1), 'scaffold.model_weights="samples"')
    reference = PfllibScaffold("495f8b4", glob, 3)
    server = alg.prepare(alg.init_server(glob), summaries([30, 50, 20]))
    states = {i: alg.init_client(glob, i) for i in range(3)}
    ctxs = [client(0, 30, epochs=1), client(1, 50, epochs=1)]
    server, _ = pflkit_round(alg, server, states, ctxs)
    reference.aggregate([(*reference.train(ctx, 1)[1:], ctx.num_train) for ctx in ctxs])
    assert_expected_close(server["global"], reference.x)  # the same x: only c differs
    assert_expected_close(server[CONTROL], reference.c)


def test_pfllib_before_d832e76_takes_k_from_one_epoch_and_a_client_without_a_full_batch_has_none():
    """Before its fix PFLlib's K ignores E: with E = 2 its c_i is twice the mean gradient pflkit
    gives. A client of 4 samples has no full batch in PFLlib's loader (drop_last): K = 0 there, one
    batch of its 4 samples in pflkit."""
    ctx = client(0, 30, epochs=2)
    glob = params_of(ctx, 2)
    alg = build("scaffold", ctx)
    server = alg.prepare(alg.init_server(glob), summaries([30, 4]))
    states = {0: alg.init_client(glob, 0), 1: alg.init_client(glob, 1)}
    small = client(1, 4, epochs=2)
    server, uploads = pflkit_round(alg, server, states, [ctx, small])
    first = PfllibScaffold("495f8b4", glob, 2)
    first.train(ctx, 2)
    assert_expected_close(first.client_c[0], {k: 2 * v for k, v in states[0][CONTROL].items()})
    assert uploads[1]["local_steps"] == 2 and int(small.num_train) // BATCH == 0
    with pytest.raises(ZeroDivisionError):
        PfllibScaffold("d832e76", glob, 2).train(small, 2, num_batches=int(small.num_train) // BATCH)
    assert_finite(states[1][CONTROL])


def test_a_run_of_clients_of_1_to_500_samples_at_half_participation_stays_finite_and_c_is_the_mean_c_i():
    """Through the round driver (clients sampled at random, N = 4): c = (1/N) Σ_i c_i over all
    clients after every run, as c ← c + (1/N) Σ Δc keeps it, and every number finite."""
    from pflkit.engines import LoopEngine

    data = make_data([1, 9, 60, 500])
    setup, init = setup_for("scaffold", data)
    for rounds in (1, 3):
        state = simulate_rounds(setup, LoopEngine(), init, rounds, join_ratio=0.5)
        controls = [state.clients.get(i)[CONTROL] for i in range(4)]
        assert sum(any(v.any() for v in c.values()) for c in controls) >= 2
        assert_expected_close(state.server[CONTROL], {k: sum(c[k] for c in controls) / 4 for k in init})
        for part in (state.server["global"], state.server[CONTROL], *controls):
            assert_finite(part)
        assert all(np.isfinite(r["accuracy"]) for r in state.history if "accuracy" in r)


# ============================================================================ divergence


#: clients of 3, 40 and 400 samples: 2, 8 and 80 steps over two epochs of batch 10
UNEQUAL = [3, 40, 400]


def unequal_clients(lr: float):
    """SCAFFOLD on the UNEQUAL clients at ``lr`` and PFLlib d832e76's transcription from the same
    model: the algorithm, its server state, the client states and the reference."""
    glob = params_of(client(0, 3), 2)
    alg = build("scaffold", client(0, 3, lr=lr))
    server = alg.prepare(alg.init_server(glob), summaries(UNEQUAL))
    states = {i: alg.init_client(glob, i) for i in range(len(UNEQUAL))}
    return alg, server, states, PfllibScaffold("d832e76", glob, len(UNEQUAL), lr=lr)


def test_clients_of_2_to_80_steps_match_pfllib_round_after_round():
    """Clients of 3, 40 and 400 samples (K = 2, 8 and 80 steps over two epochs) at lr 0.2: four rounds
    match PFLlib d832e76 (each client's own K), the unequal step counts of PFLlib issue 152. (Later
    rounds part the two: this lr sits near divergence, where float rounding, which differs between
    CPU kernels, is amplified.)"""
    sizes, lr = UNEQUAL, 0.2
    alg, server, states, reference = unequal_clients(lr)
    for t in range(1, 5):
        ctxs = [client(i, n, round=t, lr=lr) for i, n in enumerate(sizes)]
        reference.aggregate([(*reference.train(ctx, 2)[1:], ctx.num_train) for ctx in ctxs])
        server, uploads = pflkit_round(alg, server, states, ctxs)
        assert [u["local_steps"] for u in uploads] == [2, 8, 80]
        assert_expected_close(server["global"], reference.x)
        assert_expected_close(server[CONTROL], reference.c)
        for i in range(len(sizes)):
            assert_expected_close(states[i][CONTROL], reference.client_c[i])


def test_a_client_whose_training_diverges_stops_the_run_naming_it_where_pfllib_goes_on_with_nan():
    """At lr 1.0 the 80-step client's corrected steps diverge in PFLlib's transcription (its model
    becomes NaN, silently) as in pflkit, which stops with an error naming the round, the client and
    SCAFFOLD's control variates."""
    sizes, lr = UNEQUAL, 1.0
    alg, server, states, reference = unequal_clients(lr)
    error = None
    for t in range(1, 6):
        ctxs = [client(i, n, round=t, lr=lr) for i, n in enumerate(sizes)]
        reference.aggregate([(*reference.train(ctx, 2)[1:], ctx.num_train) for ctx in ctxs])
        if error is None:
            try:
                server, _ = pflkit_round(alg, server, states, ctxs)
            except NonFiniteLossError as raised:
                error = (t, str(raised))
    assert error is not None
    assert f"client 2, round {error[0]}" in error[1] and "SCAFFOLD's server control variate c had norm" in error[1]
    size = sum(float(v.double().pow(2).sum()) for v in reference.x.values())
    assert not size < 1e12  # the transcription's x exploded too (or is NaN)


def test_a_non_finite_control_variate_stops_the_client_and_the_server_naming_the_client_and_round():
    """A client of 3 samples at lr 1e-39 takes one step of finite loss, but 1/(K lr) overflows float32
    and its c_i⁺ is not finite: the client raises. An upload of a non-finite Δc is refused."""
    ctx = client(1, 3, round=7, epochs=1, lr=1e-39)
    glob = params_of(ctx, 2)
    alg = build("scaffold", ctx)
    server = alg.prepare(alg.init_server(glob), summaries([3, 30]))
    payload = alg.downlink(server, 1, 7)
    state, _ = alg.local_init(payload, alg.init_client(glob, 1), ctx)
    with pytest.raises(NonFiniteLossError, match="control variate c_i of client 1 became non-finite in round 7"):
        alg.local_train(payload, state, ctx)
    delta = {**zeros_like(glob), "fc.bias": torch.full_like(glob["fc.bias"], float("inf"))}
    upload = {"params": glob, "num_samples": 3, "client_id": 1, CONTROL_DELTA: delta}
    with pytest.raises(ValueError, match="client 1 uploaded a non-finite Δc in round 7"):
        alg.aggregate(server, [upload], 7)


def test_each_round_reports_the_largest_control_variate_and_its_client():
    sizes = [5, 30, 60]
    glob = params_of(client(0, 5), 2)
    alg = build("scaffold", client(0, 5))
    server = alg.prepare(alg.init_server(glob), summaries(sizes))
    states = {i: alg.init_client(glob, i) for i in range(len(sizes))}
    metrics = {}
    for i, n in enumerate(sizes):
        ctx = client(i, n)
        payload = alg.downlink(server, i, 1)
        state, _ = alg.local_init(payload, states[i], ctx)
        states[i], _, metrics[i] = alg.local_train(payload, state, ctx)
    norms = [float(sum(v.double().pow(2).sum() for v in states[i][CONTROL].values()).sqrt()) for i in range(3)]
    assert [float(metrics[i][CONTROL_NORM]) for i in range(3)] == pytest.approx(norms)
    assert alg.round_metrics(metrics) == {"control_norm_client": int(np.argmax(norms))}
    assert alg.metric_reductions[CONTROL_NORM] == "max"

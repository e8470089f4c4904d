"""FedBN: batch-norm layers (affine weights and running statistics) stay on the client; against my
transcription of PFLlib f1e313a (``clients/clientbn.py``, ``servers/serverbn.py``, with
``clientbase.py`` and ``serverbase.py``) and of the authors' ``communication`` (med-air/FedBN
``federated/fed_digits.py``); batched on vmap with each client's own statistics."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from pflkit.algorithms import TrainSettings
from pflkit.config import ConfigError, load_config
from pflkit.data.federated import ClientData, FederatedData
from pflkit.engines import LoopEngine, SingleClientContext, VmapEngine
from pflkit.engines.batched import BatchedClientContext
from pflkit.engines.executor import batching_blocker
from pflkit.engines.stacking import stack, unstack
from pflkit.functional import classification_loss
from pflkit.methods import build_algorithm
from pflkit.models import build_model
from tests.support.builders import batch_pairs, client_context, make_data, run_rounds
from tests.support.checks import assert_params_close, moved
from tests.support.references import pfllib_server_average

BN = ("bn1", "bn2", "bn3", "bn4", "bn5")

#: The tolerance of a batched fit against the client alone on this toy BN model. The two round
#: differently (vmapped kernels; AVX2, AVX-512 or generic CPU code), and now and then a ReLU or a
#: max-pool picks the other branch on one value: from there the fits part by up to 2e-2 (measured,
#: 1e-6 otherwise). Statistics updated from the wrong clients' batches, or not written back, move
#: them by 1e-1 and more.
BRANCH_FLIP = 5e-2


def bn_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("fedbn_cnn", (1, 8, 8), 10)


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and running statistics (pflkit's model dict)."""
    out = {k: v.detach().clone() for k, v in model.named_parameters()}
    out.update({k: b.detach().clone() for k, b in model.named_buffers() if b.is_floating_point()})
    return out


def fedbn(ctx: SingleClientContext):
    return build_algorithm("fedbn", load_config(None, []).algorithm_sections(), ctx.train, ctx.units)


def pfllib_clientbn_round(local: torch.nn.Module, server: torch.nn.Module, batches, lr: float) -> dict:
    """clientbn.py: ``set_parameters`` copies each of the server model's ``named_parameters`` whose
    name has no ``bn`` into the client's (buffers never travel); ``train``: model.train(), E epochs
    of torch.optim.SGD(lr) with CrossEntropyLoss over all of the model, per batch."""
    net = copy.deepcopy(local)
    for (name, theirs), (_, mine) in zip(server.named_parameters(), net.named_parameters()):
        if "bn" not in name:
            mine.data = theirs.data.clone()
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return state_of(net)


def authors_communication(server: dict, models: list[dict], weights: list[float]) -> tuple[dict, list[dict]]:
    """fed_digits.py ``communication`` with mode fedbn: every state-dict key without ``bn`` becomes
    the weighted sum of the clients' tensors, on the server and on every client; ``bn`` keys stay."""
    server, models = dict(server), [dict(m) for m in models]
    for key in server:
        if "bn" not in key:
            temp = torch.zeros_like(server[key])
            for m, w in zip(models, weights):
                temp += w * m[key]
            server[key] = temp
            for m in models:
                m[key] = temp.clone()
    return server, models


def test_fedbn_is_pfllib_clientbn_with_the_authors_communication():
    sizes = (30, 20)
    ctxs = [
        client_context(i, n_train=n, data_seed=i, model=bn_model(0), batch_size=10, local_epochs=2, lr=0.05)
        for i, n in enumerate(sizes)
    ]
    alg = fedbn(ctxs[0])
    server_net = bn_model(1)
    glob = state_of(server_net)
    server = alg.init_server(glob)
    payload = alg.downlink(server, 0, 1)
    shared = [k for k in glob if not k.startswith(BN)]
    assert sorted(payload["global"]) == sorted(shared)  # no batch-norm weight, bias or statistic travels
    locals_ = [bn_model(7 + i) for i in range(2)]
    for net in locals_:  # earlier rounds left each client statistics of its own
        with torch.no_grad():
            net.train()
            net(torch.randn(16, 1, 8, 8) * (2.0 + len(sizes)))
    refs, uploads = [], []
    for i, ctx in enumerate(ctxs):
        state, _ = alg.local_init(payload, alg.init_client(state_of(locals_[i]), i), ctx)
        kept = {k: v for k, v in state_of(locals_[i]).items() if k.startswith(BN)}
        assert_params_close({k: state["model"][k] for k in kept}, kept)  # its batch norm stays its own
        new, upload, _ = alg.local_train(payload, state, ctx)
        ref = pfllib_clientbn_round(locals_[i], server_net, batch_pairs(ctx, "train", 2), lr=0.05)
        assert_params_close(new["model"], ref)  # the statistics too: training-mode forwards
        assert sorted(upload["params"]) == sorted(shared)
        refs.append(ref)
        uploads.append({**upload, "client_id": i})
    assert moved({k: refs[0][k] for k in ("bn1.running_mean", "bn4.weight")}, state_of(locals_[0]))
    out = alg.aggregate(server, uploads, 1)["global"]
    total = sum(sizes)
    expected = pfllib_server_average([{k: r[k] for k in shared} for r in refs], list(sizes))
    assert_params_close({k: out[k] for k in shared}, expected)
    _, clients = authors_communication(glob, refs, [n / total for n in sizes])  # their weights: 1/N
    for i in range(2):  # next round: the global layers arrive, the batch norm stays
        state, _ = alg.local_init(alg.downlink({"global": out}, i, 2), {"model": refs[i]}, ctxs[i])
        assert_params_close(state["model"], clients[i])


def test_a_model_without_batch_norm_is_refused_in_one_line():
    plain = build_model("digits_cnn", (1, 8, 8), 10)
    alg = build_algorithm("fedbn+ala", load_config(None, []).algorithm_sections(), TrainSettings(), plain.units())
    with pytest.raises(ValueError) as error:
        alg.check_model(plain)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("fedbn keeps the model's batch-norm layers on each client, and DigitsCNN has none")
    with_bn = bn_model(0)
    build_algorithm("fedbn", load_config(None, []).algorithm_sections(), TrainSettings(), with_bn.units()).check_model(
        with_bn
    )


def test_the_cli_refuses_fedbn_on_a_model_without_batch_norm_before_the_run(tmp_path):
    from pflkit.run.experiment import run_experiment

    config = load_config(None, ['algorithms=["fedbn"]', "rounds=1", "num_clients=4"])
    with pytest.raises(ConfigError, match="fedbn keeps the model's batch-norm layers") as error:
        run_experiment(config, tmp_path / "out", progress=False, echo=lambda s: None)
    assert str(error.value).endswith(f"(model = {config.model_for((1, 8, 8))!r})")  # the config's name for it
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def batched_vs_single_fit(sizes, stats_seed: int = 3):
    """One epoch of cross-entropy on K clients of ``sizes`` whose models and running statistics all
    differ: the batched context (one vmapped step per step) and each client alone."""
    torch.manual_seed(0)
    model = bn_model(0)
    g = torch.Generator().manual_seed(stats_seed)
    clients, params = [], []
    for k, n in enumerate(sizes):
        x, y = torch.randn(n + 4, 1, 8, 8, generator=g), torch.randint(0, 10, (n + 4,), generator=g)
        clients.append(ClientData(k, x[:n], y[:n], x[n:], y[n:]))
        p = {key: v + 0.05 * torch.randn(v.shape, generator=g) for key, v in state_of(model).items()}
        for key in p:
            if key.endswith("running_var"):
                p[key] = p[key].abs() + 0.5
        params.append(p)
    data = FederatedData.from_clients(clients, 10, "toy")
    train = TrainSettings(batch_size=10, local_epochs=1, lr=0.05)
    single = [
        SingleClientContext(k, 1, 0, data.client(k), model, model.units(), train, "test").fit(
            params[k], classification_loss
        )
        for k in range(len(sizes))
    ]
    bctx = BatchedClientContext(list(range(len(sizes))), 1, 0, data, model, model.units(), train, "test")
    fit = bctx.fit(stack(params, torch.device("cpu")), classification_loss)
    return single, [unstack(fit.params, k, params[k]) for k in range(len(sizes))], params


def test_fedbn_batches_on_vmap_as_client_by_client():
    """Clients of unequal step counts (each step runs a prefix of the running set, reordered by
    size) and statistics of their own: the batched fit updates each client's statistics from its own
    batches only, as the client alone does."""
    single, batched, before = batched_vs_single_fit([30, 50, 20, 40])
    for k, (a, b) in enumerate(zip(single, batched)):
        assert_params_close(b, a.params, atol=BRANCH_FLIP)
        assert moved({"bn4.running_mean": b["bn4.running_mean"]}, before[k])
        assert not torch.allclose(b["bn4.running_mean"], batched[(k + 1) % 4]["bn4.running_mean"])


def test_vmap_engine_runs_fedbn_batched_and_tiny_clients_one_by_one(caplog):
    """FedBN batches on vmap; a client smaller than one batch would be padded, and padding would
    enter the batch statistics, so then the engine runs the clients one by one and says why. One
    round: this BN model on the toy data is chaotic (a 1e-6 change of the initial model moves the
    loop engine's clients by up to 0.45 after two rounds, measured), so two rounds compare chaos."""
    data = make_data([30, 45, 12, 60, 20])
    assert batching_blocker(fedbn(client_context(model=bn_model(0))), bn_model(0), data) is None
    loop = run_rounds("fedbn", LoopEngine(), data, rounds=1)
    assert_state_close(loop, run_rounds("fedbn", VmapEngine(2), data, rounds=1))
    tiny = make_data([30, 7, 20])
    reason = batching_blocker(fedbn(client_context(model=bn_model(0))), bn_model(0), tiny)
    assert reason is not None and "client 1 holds fewer training samples (7) than one batch (10)" in reason
    with caplog.at_level("INFO", logger="pflkit.engines.executor"):
        batched = run_rounds("fedbn", VmapEngine(), tiny, rounds=1)
    assert any("fewer training samples" in r.getMessage() for r in caplog.records)
    assert_state_close(run_rounds("fedbn", LoopEngine(), tiny, rounds=1), batched)


def assert_state_close(a, b, atol: float = BRANCH_FLIP) -> None:
    for c in range(len(a.clients)):
        assert_params_close(a.clients[c]["model"], b.clients[c]["model"], atol=atol)
    for ra, rb in zip(a.history, b.history, strict=True):
        assert ra.get("accuracy") == pytest.approx(rb.get("accuracy"), abs=0.05 + 1e-9)


def test_a_batched_fit_refuses_a_padded_batch_norm_batch():
    with pytest.raises(NotImplementedError, match="padding in the batch statistics"):
        batched_vs_single_fit([30, 7])


@pytest.mark.integration
def test_fedbn_resumes_after_an_interruption_to_the_uninterrupted_numbers(tmp_path, fast_config):
    from pflkit.run.experiment import resume_experiment, run_experiment
    from tests.support.runs import InterruptAfter, records_without_timings

    config = load_config(None, fast_config + ['algorithms=["fedbn"]', 'model="fedbn_cnn"', "rounds=3"])
    run_experiment(config, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            config, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedbn", 2)]
        )
    resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    assert records_without_timings(tmp_path / "cut") == records_without_timings(tmp_path / "full")

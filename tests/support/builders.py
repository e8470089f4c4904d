"""Builders shared by the tests: clients of random 8x8 samples with the digits CNN, methods built
from config overrides, small federations and the rounds that run them."""

from __future__ import annotations

import numpy as np
import torch

from pflkit.algorithms import ClientSummary, TrainBatches, TrainSettings
from pflkit.config import load_config
from pflkit.data.federated import ClientData, FederatedData
from pflkit.engines import RoundSetup, SingleClientContext
from pflkit.methods import build_algorithm
from pflkit.models import build_model


# ---- clients -----------------------------------------------------------------------------------
def client_context(
    client_id: int = 0,
    *,
    n_train: int = 30,
    n_test: int = 8,
    data_seed: int = 0,
    classes: list[int] | None = None,
    model: torch.nn.Module | None = None,
    model_seed: int = 0,
    round: int = 1,
    seed: int = 0,
    algorithm: str = "test",
    **train,
) -> SingleClientContext:
    """Client ``client_id`` holding ``n_train`` training and ``n_test`` test samples: random 8x8
    inputs drawn from ``data_seed``, labels uniform over ``classes`` (all ten by default), and the
    digits CNN initialised from ``model_seed`` (or ``model`` itself); ``train`` are the fields of its
    TrainSettings, passed as given (the other fields keep their defaults)."""
    if model is None:
        torch.manual_seed(model_seed)
        model = build_model("digits_cnn", (1, 8, 8), 10)
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randn(n_train + n_test, 1, 8, 8, generator=g)
    labels = torch.arange(10) if classes is None else torch.tensor(classes)
    y = labels[torch.randint(0, len(labels), (n_train + n_test,), generator=g)]
    data = ClientData(client_id, x[:n_train], y[:n_train], x[n_train:], y[n_train:])
    return SingleClientContext(
        client_id=client_id,
        round=round,
        seed=seed,
        data=data,
        model=model,
        units=model.units(),
        train=TrainSettings(**train),
        algorithm=algorithm,
    )


def tiny_context(
    n_train: int = 30, seed: int = 0, round: int = 1, batch_size: int = 10, lr: float = 0.1, epochs: int = 1
) -> SingleClientContext:
    """Client 0 with ``n_train`` random 8x8 samples and the digits CNN, both drawn from ``seed``
    (a one-round run: ``rounds = 1``)."""
    return client_context(
        0,
        n_train=n_train,
        data_seed=seed,
        model_seed=seed,
        round=round,
        seed=seed,
        batch_size=batch_size,
        local_epochs=epochs,
        lr=lr,
        rounds=1,
    )


def client_ctx(
    cid: int,
    *,
    n_train: int = 30,
    batch_size: int = 10,
    lr: float = 0.1,
    round: int = 1,
    rounds: int = 1,
    model=None,
    n_test: int = 8,
    seed: int = 0,
) -> SingleClientContext:
    """Client ``cid`` with its own random 8x8 samples (data seed 1000 + cid) and the digits CNN
    (seed 0, shared by every client: pass ``model`` to share the very module)."""
    return client_context(
        cid,
        n_train=n_train,
        n_test=n_test,
        data_seed=1000 + cid,
        model=model,
        round=round,
        seed=seed,
        batch_size=batch_size,
        local_epochs=1,
        lr=lr,
        rounds=rounds,
    )


def seeded_client(
    n_train: int,
    seed: int = 0,
    client_id: int = 0,
    classes: list[int] | None = None,
    batch_size: int = 10,
    lr: float = 0.1,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    epochs: int = 1,
    round: int = 1,
) -> SingleClientContext:
    """One client of random 8x8 inputs (labels drawn from ``classes``) and the digits CNN, both
    drawn from ``seed``, training under the given optimiser settings (``rounds`` left at its default)."""
    return client_context(
        client_id,
        n_train=n_train,
        data_seed=seed,
        classes=classes,
        model_seed=seed,
        round=round,
        seed=seed,
        batch_size=batch_size,
        local_epochs=epochs,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
    )


def params_of(ctx: SingleClientContext, seed: int) -> dict[str, torch.Tensor]:
    """The parameters of a fresh digits CNN initialised from ``seed``."""
    torch.manual_seed(seed)
    fresh = build_model("digits_cnn", (1, 8, 8), 10)
    return {k: v.detach().clone() for k, v in fresh.named_parameters()}


def perturbed(params: dict, seed: int, size: float) -> dict:
    """``params`` plus ``size`` times standard normal noise drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + size * torch.randn(v.shape, generator=g) for k, v in params.items()}


def batch_pairs(ctx: SingleClientContext, purpose: str = "train", epochs: int = 1) -> list[tuple]:
    """The context's mini-batches of ``purpose`` as (x, y) pairs."""
    return [(b.x, b.y) for b in ctx.batches(TrainBatches(purpose, epochs))]


def stream(ctx, purpose: str, batch_size: int | None = None, holdout: float = 0.0):
    """The context's mini-batches of ``purpose`` (full batches, reshuffled per stream)."""
    return [(b.x, b.y) for b in ctx.batches(TrainBatches(purpose, 1, batch_size, holdout=holdout))]


def fit_on(model, params: dict, batches: list[tuple], lr: float, trainable=None):
    """``ctx.fit`` of cross-entropy over exactly ``batches`` (in order, equal sizes) of one client."""
    from pflkit.algorithms import Sample, SampleBatches
    from pflkit.functional import classification_loss

    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    data = ClientData(0, x, y, x[:1], y[:1])
    ctx = SingleClientContext(
        0, 1, 0, data, model, model.units(), TrainSettings(batch_size=len(batches[0][1]), lr=lr), "test"
    )
    fit = ctx.fit(params, classification_loss, trainable=trainable, data=SampleBatches(Sample(x, y)))
    return fit.params, fit.loss


# ---- methods -----------------------------------------------------------------------------------
def build(name: str, ctx, *overrides: str):
    """The method ``name`` configured by ``overrides`` for ``ctx``'s training settings and units."""
    return build_algorithm(name, load_config(None, list(overrides)).algorithm_sections(), ctx.train, ctx.units)


def summaries(sizes) -> list[ClientSummary]:
    """Clients 0, 1, ... with ``sizes`` training samples (label counts all zero)."""
    return [ClientSummary(i, n, np.zeros(10)) for i, n in enumerate(sizes)]


def two_client_round(name: str, ctxs, glob: dict, *overrides: str):
    """pflkit's round on two clients (sizes 30 and 20) from ``glob``: downlink, local_init, local_train,
    aggregate. Returns (server after aggregation, per-client trained states, uploads)."""
    alg = build(name, ctxs[0], *overrides)
    server = alg.init_server(glob)
    states, uploads = [], []
    for i, ctx in enumerate(ctxs):
        payload = alg.downlink(server, i, 1)
        state, _ = alg.local_init(payload, alg.init_client(params_of(ctx, 7 + i), i), ctx)
        new, upload, _ = alg.local_train(payload, state, ctx)
        states.append(new)
        uploads.append({**upload, "client_id": i})
    return alg, alg.aggregate(server, uploads, 1), states, uploads


def sosicfl_setup(name: str, *overrides: str, epochs: int = 1):
    """Two clients of three classes each and ``name`` prepared on them (two clusters), the server's
    global model moved off its initialisation."""
    # floco's config/cifar10_fold.yaml: SGD lr 0.02, momentum 0.5, weight decay 5e-4
    ctxs = [
        seeded_client(
            30, seed=6, client_id=0, classes=[0, 1, 2], lr=0.02, momentum=0.5, weight_decay=5e-4, epochs=epochs
        ),
        seeded_client(
            50, seed=7, client_id=1, classes=[7, 8, 9], lr=0.02, momentum=0.5, weight_decay=5e-4, epochs=epochs
        ),
    ]
    alg = build(name, ctxs[0], "sosicfl.num_clusters=2", "sosicfl.pool_size=200", "sosicfl.n_init=2", *overrides)
    summaries = [ClientSummary(c.client_id, c.num_train, c.label_counts.numpy()) for c in ctxs]
    server = alg.prepare(alg.init_server(params_of(ctxs[0], 2)), summaries)
    server = {
        **server,
        "global": {
            k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9))
            for k, v in server["global"].items()
        },
    }
    return ctxs, alg, server


# ---- federations and their rounds --------------------------------------------------------------
#: the settings of the engine tests' runs (short ALA start phases, one head and one personal epoch)
# CReFF's server step (feature matching, classifier re-training) runs on the server whatever the engine:
# the engine and streaming parities run it small (tests/methods/test_creff.py checks it at full size)
ENGINE_OVERRIDES = (
    "fedala.max_start_epochs=3",
    "fedrep.head_epochs=1",
    "ditto.personal_epochs=1",
    "creff.match_steps=5",
    "creff.retrain_epochs=10",
    "creff.features=20",
)


def make_data(sizes: list[int], seed: int = 0, test: int = 4, device: str = "cpu") -> FederatedData:
    """Clients with exactly ``sizes`` training samples of learnable 8x8 data (on ``device``)."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(10, 1, 8, 8, generator=g)
    clients = []
    for i, n in enumerate(sizes):
        y = torch.randint(0, 10, (n + test,), generator=g)
        x = means[y] + 0.5 * torch.randn(n + test, 1, 8, 8, generator=g)
        x, y = x.to(device), y.to(device)
        clients.append(ClientData(i, x[:n], y[:n], x[n:], y[n:]))
    return FederatedData.from_clients(clients, 10, "toy")


def model_for_method(name: str) -> str:
    """The engine tests' model of method ``name``: the digits CNN, or FedBN's digit CNN for a method
    that keeps the batch-norm layers on its clients."""
    from pflkit.methods import method_class

    return "fedbn_cnn" if getattr(method_class(name), "personal_part", None) == "norm" else "digits_cnn"


def setup_for(name: str, data, seed: int = 3, overrides=(), device: str = "cpu", model_name: str | None = None):
    """The engine tests' run of ``name`` on ``data`` (ENGINE_OVERRIDES, then ``overrides``) with
    ``model_name`` (default ``model_for_method(name)``): its setup and initial model (parameters and
    batch-norm statistics)."""
    cfg = load_config(None, [*ENGINE_OVERRIDES, *overrides])
    torch.manual_seed(0)
    model = build_model(model_name or model_for_method(name), (1, 8, 8), 10).to(device)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    init.update({k: b.detach().clone() for k, b in model.named_buffers() if b.is_floating_point()})
    train = TrainSettings(batch_size=10, local_epochs=1, lr=0.05)
    alg = build_algorithm(name, cfg.algorithm_sections(), train, model.units())
    return RoundSetup(alg, data, model, model.units(), train, seed), init


def simulate_rounds(setup, engine, init: dict, rounds: int, join_ratio: float = 1.0, eval_every: int = 1):
    """``rounds`` rounds (and the final evaluation) of ``setup`` on ``engine`` from ``init``."""
    from pflkit.federation import RoundDriver, RunSession

    data = setup.data
    driver = RoundDriver(
        setup.algorithm,
        num_clients=data.num_clients,
        seed=setup.seed,
        rounds=rounds,
        join_ratio=join_ratio,
        eval_every=eval_every,
    )
    summaries = [
        ClientSummary(i, data.client(i).num_train, data.train_label_counts(i)) for i in range(data.num_clients)
    ]
    return RunSession.open(driver, init, summaries).run(lambda jobs, round: engine.run(setup, jobs, round))


def run_rounds(
    name: str, engine, data: FederatedData, rounds: int = 2, overrides=(), device: str = "cpu", model_name=None
):
    """``rounds`` rounds of the engine tests' run of ``name`` on ``engine``: the final run state."""
    setup, init = setup_for(name, data, overrides=overrides, device=device, model_name=model_name)
    return simulate_rounds(setup, engine, init, rounds)


def session_for(setup, init, store=None):
    """A two-round session of ``setup`` from ``init`` (every client every round)."""
    from pflkit.federation import RoundDriver, RunSession

    data = setup.data
    driver = RoundDriver(
        setup.algorithm, num_clients=data.num_clients, seed=setup.seed, rounds=2, join_ratio=1.0, eval_every=1
    )
    summaries = [
        ClientSummary(i, data.client(i).num_train, data.train_label_counts(i)) for i in range(data.num_clients)
    ]
    return RunSession.open(driver, init, summaries, store=store)

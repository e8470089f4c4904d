"""Every engine runs the same algorithm code to the same numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pflkit.algorithms import TrainSettings
from pflkit.config import load_config
from pflkit.engines import ClientExecutor, LoopEngine, ParallelEngine, VmapEngine, build_engine
from pflkit.engines.executor import batching_blocker
from pflkit.methods import available, build_algorithm
from pflkit.models import build_model
from tests.support.builders import make_data, model_for_method, run_rounds
from tests.support.checks import assert_same_state, assert_states_close
from tests.support.params import by_method

ALL_ALGORITHMS = available()


@pytest.mark.parametrize("name", by_method(ALL_ALGORITHMS))
def test_parallel_engine_matches_loop_for_every_algorithm_and_worker_count(name):
    data = make_data([30, 45, 12, 60])
    reference = run_rounds(name, LoopEngine(), data)
    runs = []
    for workers in (1, 2, 3):  # chunks of 2 clients: ALA's chunks run concurrently with 2 and 3 workers
        engine = ParallelEngine(workers, receive_chunk=2)
        try:
            runs.append(run_rounds(name, engine, data))
        finally:
            engine.close()
    assert_same_state(runs[0], runs[1])  # bit-identical whatever the number of workers
    assert_same_state(runs[0], runs[2])
    if "ala" in name:  # ALA runs batched across clients on this engine: float reassociation only
        assert_close_runs(reference, runs[0], atol=tolerance(name))
    else:
        assert_same_state(reference, runs[0])


@pytest.mark.parametrize("name", ["fedavg", "fedala", "fedrep", "ditto+ala"])
def test_clients_of_1_9_10_and_500_samples_in_one_round(name):
    data = make_data([1, 9, 10, 500])
    reference = run_rounds(name, LoopEngine(), data, rounds=2)
    engine = ParallelEngine(2)
    try:
        assert_close_runs(reference, run_rounds(name, engine, data, rounds=2), atol=tolerance(name))
    finally:
        engine.close()
    for record in reference.history:
        assert np.isfinite(record["accuracy"])
        assert record["evaluated_clients"] == 4


def vmap_fallback(name: str) -> str | None:
    """Why the vmap engine runs ``name``'s clients one by one on the test model, or None."""
    model = build_model("digits_cnn", (1, 8, 8), 10)
    train = TrainSettings(batch_size=10, local_epochs=1, lr=0.05)
    alg = build_algorithm(name, load_config(None, []).algorithm_sections(), train, model.units())
    return batching_blocker(alg, model, make_data([5]))


#: methods of a batch-norm model (FedBN) are compared over one round, with clients of at least a
#: batch, in tests/methods/test_fedbn.py: on the toy data that model is chaotic over two rounds
BATCHED = [name for name in ALL_ALGORITHMS if vmap_fallback(name) is None and model_for_method(name) == "digits_cnn"]


UNBATCHED = [name for name in ALL_ALGORITHMS if vmap_fallback(name) is not None]


@pytest.mark.parametrize("name", by_method(BATCHED))
def test_vmap_engine_matches_loop_for_every_batched_algorithm(name, monkeypatch):
    data = make_data([30, 45, 12, 60, 7])
    reference = run_rounds(name, LoopEngine(), data)
    chunks = []
    real = ClientExecutor._run_group
    monkeypatch.setattr(
        ClientExecutor,
        "_run_group",
        lambda self, setup, jobs, round, ctx, received: (
            chunks.append(len(jobs)) or real(self, setup, jobs, round, ctx, received)
        ),
    )
    for chunk in (2, 64):
        chunks.clear()
        batched = run_rounds(name, VmapEngine(chunk_size=chunk), data)
        # it really ran batched: every round's five clients in chunks of at most ``chunk``
        assert chunks and sum(chunks) % 5 == 0 and max(chunks) == min(chunk, 5)
        assert_close_runs(reference, batched, atol=tolerance(name))


@pytest.mark.parametrize(
    "name, split", [("fedper", "fedper.personal_units=2"), ("lgfedavg", "lgfedavg.global_units=3")]
)
def test_vmap_engine_matches_loop_for_deeper_personal_parts(name, split):
    data = make_data([30, 45, 12, 60, 7])
    reference = run_rounds(name, LoopEngine(), data, overrides=[split])
    assert_close_runs(reference, run_rounds(name, VmapEngine(chunk_size=2), data, overrides=[split]), atol=1e-5)


def test_vmap_engine_matches_loop_for_feddecorrs_well_conditioned_form():
    data = make_data([30, 45, 12, 60, 7])
    paper = ["feddecorr.form='paper'"]
    assert_close_runs(
        run_rounds("feddecorr", LoopEngine(), data, overrides=paper),
        run_rounds("feddecorr", VmapEngine(chunk_size=2), data, overrides=paper),
        atol=1e-5,
    )


def test_vmap_engine_runs_the_unbatchable_algorithms_client_by_client(caplog):
    """FedFomo and PartialFed need per-client code (FedFomo scores other clients' models on its own
    validation split, PartialFed switches layers by client): the vmap engine says so once and
    gives the loop engine's numbers exactly, since it runs the same per-client code."""
    assert sorted(UNBATCHED) == ["fedfomo", "partialfed", "partialfed+ala"]
    data = make_data([30, 45, 12, 60, 7])
    for name in UNBATCHED:
        caplog.clear()
        with caplog.at_level("INFO", logger="pflkit.engines.executor"):
            fallback = run_rounds(name, VmapEngine(), data)
        assert [r.getMessage() for r in caplog.records if r.name == "pflkit.engines.executor"] == [
            f"vmap engine: {vmap_fallback(name)}; running {name}'s clients one by one"
        ]
        assert "client code" in vmap_fallback(name)
        assert_same_state(run_rounds(name, LoopEngine(), data), fallback)


@pytest.mark.parametrize("name", ["fedavg", "fedala", "fedrep+ala", "ditto+ala"])
def test_vmap_clients_of_1_9_10_and_500_samples(name):
    data = make_data([1, 9, 10, 500])
    assert_close_runs(run_rounds(name, LoopEngine(), data), run_rounds(name, VmapEngine(), data), atol=tolerance(name))


def tolerance(name: str) -> float:
    """Batched kernels reassociate float sums (~1e-7 per step). Plain SGD keeps that at ~1e-7 after a
    round; ALA's start phase (clipped weights, eta=1) amplifies it: a 1e-8 perturbation of one
    client's state moves that client by 4.6e-4 even on the loop engine alone (measured). FedDecorr's
    reference loss divides by sqrt(var + 1e-8) per feature: on this tiny CNN one fc1 feature barely
    varies within a batch; scaling the inputs by 1 + 1e-7 moves the loop engine's model by 1.2e-3
    and vmap differs from loop by 2.3e-3 there (measured, 1 thread); its paper form (eps 1e-5) is
    checked at 1e-5 in test_vmap_engine_matches_loop_for_feddecorrs_well_conditioned_form."""
    if name == "feddecorr":
        return 5e-3
    return 1e-3 if "ala" in name else 1e-5


def assert_close_runs(a, b, atol):
    """Same parameters within ``atol`` and the same metrics (accuracies within one test sample)."""
    assert_states_close(a, b, atol)
    for ra, rb in zip(a.history, b.history, strict=True):
        assert ra["round"] == rb["round"]
        if "accuracy" in ra:
            assert abs(ra["accuracy"] - rb["accuracy"]) <= 1 / 20 + 1e-9
            assert ra["test_loss"] == pytest.approx(rb["test_loss"], rel=10 * atol, abs=1e-4)
        if "ala_epochs" in ra:
            assert ra["ala_epochs"] == rb["ala_epochs"]


def test_vmap_batches_every_method_but_those_with_per_client_code():
    from pflkit.engines.executor import batching_blocker

    cfg = load_config(None, [])
    model = build_model("digits_cnn", (1, 8, 8), 10)
    train = TrainSettings(batch_size=10, local_epochs=1, lr=0.05)
    data = make_data([30, 12])
    algorithms = {
        name: build_algorithm(name, cfg.algorithm_sections(), train, model.units()) for name in ALL_ALGORITHMS
    }
    per_client = [name for name, alg in algorithms.items() if batching_blocker(alg, model, data)]
    assert per_client == ["fedfomo", "partialfed", "partialfed+ala"]
    resnet = build_model("resnet18", (3, 32, 32), 10)
    fedavg = build_algorithm("fedavg", cfg.algorithm_sections(), train, resnet.units())
    assert batching_blocker(fedavg, resnet, data) is None  # batch norm batches, each client its statistics
    assert "fewer training samples (5) than one batch" in batching_blocker(fedavg, resnet, make_data([30, 5]))
    fedala = build_algorithm("fedala", cfg.algorithm_sections(), train, resnet.units())
    assert "padding would enter the batch statistics" in batching_blocker(fedala, resnet, data)


def test_a_batched_context_gathers_client_states_onto_its_device():
    """On CUDA the vmap engine stacks client states holding Python scalars (ALA's ``started`` flag)
    and CPU tensors; stacked, they meet the batched tensors on the GPU (FedALA's round 2 failed there
    with 'found at least two devices'), so ``gather`` puts every leaf on the context's device. The
    meta device stands in for a GPU, which this machine lacks."""
    from pflkit.engines.batched import BatchedClientContext

    model = build_model("digits_cnn", (1, 8, 8), 10)
    ctx = BatchedClientContext(
        [0, 1],
        2,
        0,
        make_data([5, 7]),
        model,
        model.units(),
        TrainSettings(batch_size=10, local_epochs=1, lr=0.1, rounds=1),
        "test",
    )
    assert ctx.device.type == "cpu"
    ctx.device = torch.device("meta")
    shared = torch.zeros(3)
    states = [
        {
            "ala": {"weights": {"w": torch.full((3,), float(k))}, "started": bool(k)},
            "steps": k,
            "scale": 0.5 * k,
            "shared": shared,
            "counter": torch.tensor(k),
        }
        for k in range(2)
    ]
    gathered = ctx.gather(states)

    def leaves(value):
        return [t for v in value.values() for t in leaves(v)] if isinstance(value, dict) else [value]

    assert len(leaves(gathered)) == 6
    assert all(isinstance(t, torch.Tensor) and t.device.type == "meta" and t.shape[0] == 2 for t in leaves(gathered))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedala", "ditto", "scaffold", "feddyn", "fedrep", "moon"])
def test_cuda_graphs_engine_runs_as_the_vmap_engine(name):
    """The vmap-graphs engine replays each epoch's steps as CUDA graphs: three rounds (ALA's start
    phase and a steady round included) score as on the vmap engine, within float reassociation."""
    sizes = [300, 450, 120, 600, 70]  # batch 10: stretches of steps long enough to be recorded
    eager = run_rounds(name, build_engine("vmap", device="cuda"), make_data(sizes, device="cuda"), 3, device="cuda")
    graphs = run_rounds(
        name, build_engine("vmap-graphs", device="cuda"), make_data(sizes, device="cuda"), 3, device="cuda"
    )
    for ra, rb in zip(eager.history, graphs.history, strict=True):
        assert ra["round"] == rb["round"]
        if "accuracy" in ra:
            assert abs(ra["accuracy"] - rb["accuracy"]) <= 2 / 20 + 1e-9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ALL_ALGORITHMS)
def test_every_algorithm_runs_on_cuda_with_the_default_engine_as_on_the_cpu(name):
    """CUDA's default engine (vmap; client by client for per-client code) runs three rounds, the ALA
    start phase and a steady round included, and scores like the CPU's loop engine (GPU kernels
    round differently and cuDNN may use TF32: accuracies within 2 of 20 test samples). A batch-norm
    model (FedBN's) runs one round on clients of at least a batch: on the toy data it is chaotic over
    rounds (tests/methods/test_fedbn.py), and over three its CPU and GPU scores part by 3 of 20."""
    bn = model_for_method(name) != "digits_cnn"
    sizes, rounds = ([30, 45, 12, 60, 20], 1) if bn else ([30, 45, 12, 60, 7], 3)
    cpu = run_rounds(name, LoopEngine(), make_data(sizes), rounds=rounds)
    gpu = run_rounds(
        name, build_engine("auto", device="cuda"), make_data(sizes, device="cuda"), rounds=rounds, device="cuda"
    )
    for ra, rb in zip(cpu.history, gpu.history, strict=True):
        assert ra["round"] == rb["round"]
        if "accuracy" in ra:
            assert abs(ra["accuracy"] - rb["accuracy"]) <= 2 / 20 + 1e-9

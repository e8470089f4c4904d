"""Streaming aggregation: a weighted-sum server rule folds each upload in as it
arrives, to the same bits as the list form, and a round on the disk store does not hold its
clients' parameters (WeightedSum itself is tested in tests/functional/)."""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from pflkit.algorithms import TrainSettings
from pflkit.algorithms.base import upload_order
from pflkit.config import load_config
from pflkit.engines import ClientJob, LoopEngine, ParallelEngine, VmapEngine
from pflkit.federation.session import on_engine
from pflkit.federation.state_store import DiskStateStore
from pflkit.methods import available, build_algorithm
from pflkit.models import build_model
from tests.support.builders import make_data, session_for, setup_for
from tests.support.checks import assert_same_state
from tests.support.params import by_method

LIST_FORM = {
    "fedfomo",
    "apple",
    "fedamp",
    "sosicfl",
    "sosicfl_all",
    "sosicfl_plus",
    "pfedme",
    "fednova",
    "fedacd",
    "creff",
    "fednh",
    "local",
    "fedgh",  # the server trains its head on every prototype of the round
    "fedcac",  # collaborators chosen from every pair of clients' masks
    "fedpac",  # a quadratic programme over every client's statistics
}


@pytest.mark.parametrize("name", by_method(available()))
def test_every_algorithm_aggregates_to_the_same_bits_streamed_or_listed(name):
    """Results arriving in a shuffled order are folded in as their turn comes; the run equals the
    one whose rounds hand every result over at once (the list form, as on Flower)."""
    data = make_data([30, 45, 12, 60, 45])
    setup, init = setup_for(name, data)
    engine = LoopEngine()
    shuffle = random.Random(0).sample
    streamed = session_for(setup, init)
    streamed.run(lambda jobs, round: shuffle(engine.run(setup, jobs, round), len(jobs)))
    listed = session_for(setup, init)
    while (plan := listed.next_plan()) is not None:
        listed.finish(plan, engine.run(setup, plan.jobs, plan.round) + engine.run(setup, plan.eval_jobs, plan.round))
    assert_same_state(streamed.state, listed.state)


@pytest.mark.parametrize("engine_factory", [lambda: ParallelEngine(2), lambda: VmapEngine(2)], ids=["parallel", "vmap"])
def test_engines_deliver_results_in_the_fold_order(engine_factory):
    setup, init = setup_for("fedavg", make_data([30, 45, 12, 60, 45]))
    jobs = [ClientJob(i, {"global": init}, setup.algorithm.init_client(init, i), True) for i in range(5)]
    engine = engine_factory()
    try:
        results = list(engine.stream(setup, jobs, 1))
    finally:
        engine.close()
    sent = [{**r.upload, "client_id": r.client_id} for r in results]
    assert [u["client_id"] for u in sent] == [u["client_id"] for u in sorted(sent, key=upload_order)] == [3, 1, 4, 0, 2]


def test_which_methods_stream():
    model = build_model("digits_cnn", (1, 8, 8), 10)
    sections = load_config(None, []).algorithm_sections()
    server = {"global": {k: v.detach() for k, v in model.named_parameters()}}
    streaming = {
        name
        for name in available()
        if name.split("+")[0] not in LIST_FORM
        and build_algorithm(name, sections, TrainSettings(), model.units()).aggregator(server, 1, 10)
    }
    listed = {
        name
        for name in available()
        if build_algorithm(name, sections, TrainSettings(), model.units()).aggregator(server, 1, 10) is None
    }
    assert {"fedavg", "fedprox", "ditto", "fedrep", "fedphp", "fedala", "fedavg+ala"} <= streaming
    assert {name.split("+")[0] for name in listed} == LIST_FORM


@pytest.mark.slow
def test_a_streamed_round_on_the_disk_store_lets_go_of_its_clients(tmp_path):
    """Each client's parameters are released once its result is taken: while a round of 40
    clients streams, at most the store's cache (2) and the result in hand are alive."""
    setup, init = setup_for("fedavg", make_data([20] * 40))
    store = DiskStateStore(tmp_path, 40, lambda i: setup.algorithm.init_client(init, i), cache=2)
    session = session_for(setup, init, store)
    engine = ParallelEngine(2)
    streamed = on_engine(engine, setup)
    alive: list[weakref.ref] = []

    def execute(jobs, round):
        for result in streamed(jobs, round):
            alive.append(weakref.ref(next(iter(result.upload["params"].values()))))
            yield result
            gc.collect()
            assert sum(ref() is not None for ref in alive) <= 3

    try:
        session.step(execute)
    finally:
        engine.close()
    assert len(alive) == 40 and session.state.rounds_done == 1


def test_alas_receive_waves_do_not_change_the_numbers():
    """The parallel engine receives (ALA) and trains a wave of 4 x workers receive chunks at a
    time: 3, 2 and 1 waves over 10 clients give the same bits."""
    data = make_data([30, 45, 12, 60, 45, 8, 21, 33, 17, 50])
    setup, init = setup_for("fedala", data)
    runs = []
    for workers in (1, 2, 3):
        engine = ParallelEngine(workers, receive_chunk=1)
        assert engine.wave == 4 * workers
        try:
            runs.append(session_for(setup, init).run(on_engine(engine, setup)))
        finally:
            engine.close()
    assert_same_state(runs[0], runs[1])
    assert_same_state(runs[0], runs[2])

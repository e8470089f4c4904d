"""Clients that never train (``[run] unseen_clients``): who they are, that they never train, how
they are scored as newcomers, and that every engine, a resumed run and Flower agree."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pflkit.algorithms import ClientSummary
from pflkit.algorithms.base import WeightedAverage
from pflkit.config import ConfigError, load_config
from pflkit.engines import LoopEngine, ParallelEngine, VmapEngine
from pflkit.federation import RoundDriver, RunSession
from pflkit.federation.newcomers import Newcomers
from pflkit.federation.session import on_engine
from pflkit.functional import evaluate
from pflkit.methods import available, method_class
from pflkit.reporting import format_table
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.support.builders import make_data, setup_for
from tests.support.params import by_method
from tests.support.runs import InterruptAfter, records_without_timings

SIZES = [30, 45, 12, 60, 45]
FAST = ["dataset=synthetic", "num_clients=5", "alpha=0.5", "rounds=2", "fedala.max_start_epochs=3", "engine=loop"]


def unseen_session(
    name, unseen=(1, 3), finetune=0, rounds=2, join_ratio=1.0, overrides=(), finetune_steps=None, finetune_lr=None
):
    """A run of ``name`` on five toy clients whose ``unseen`` never train: its setup, initial
    model and (unstarted) session."""
    data = make_data(SIZES, test=12)
    setup, init = setup_for(name, data, overrides=overrides)
    driver = RoundDriver(
        setup.algorithm,
        num_clients=data.num_clients,
        seed=setup.seed,
        rounds=rounds,
        join_ratio=join_ratio,
        eval_every=1,
        newcomers=Newcomers(tuple(unseen), finetune, init, finetune_steps, finetune_lr),
    )
    summaries = [ClientSummary(i, n, data.train_label_counts(i)) for i, n in enumerate(SIZES)]
    return setup, init, RunSession.open(driver, init, summaries)


def unseen_records(name, engine, **kwargs):
    setup, _, session = unseen_session(name, **kwargs)
    return session.run(on_engine(engine, setup)).history


# ---- who the unseen clients are ----------------------------------------------------------------
@pytest.mark.parametrize(
    "override, message",
    [
        ("unseen_clients=5", "5 unseen clients of 5 leave none to train"),
        ("unseen_clients=7", "7 unseen clients of 5 leave none to train"),
        ("unseen_clients=-1", "cannot be negative"),
        ("unseen_clients=[1, 5]", r"unseen client ids \[5\] are not clients of this run"),
        ("unseen_clients=[-1]", "client ids cannot be negative"),
        ("unseen_clients=[2, 2]", "client ids are repeated"),
        ("unseen_clients=1.0", r"must lie in \(0, 1\)"),
        ("unseen_clients=0.0", r"must lie in \(0, 1\)"),
        ("unseen_clients=[0, 1, 2, 3, 4]", "leave none to train"),
    ],
)
def test_bad_unseen_clients_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(None, [*FAST, override])
    assert len([line for line in str(caught.value).splitlines() if "unseen" in line]) == 1


def test_counts_and_fractions_take_the_last_clients_and_lists_their_ids():
    run = load_config(None, [*FAST, "num_clients=10", "unseen_clients=3"]).run
    assert run.unseen_ids(10) == [7, 8, 9]
    assert load_config(None, [*FAST, "unseen_clients=0.2"]).run.unseen_ids(20) == [16, 17, 18, 19]
    assert load_config(None, [*FAST, "unseen_clients=0.05"]).run.unseen_ids(5) == [4]  # at least one
    assert load_config(None, [*FAST, "unseen_clients=[3, 0]"]).run.unseen_ids(5) == [0, 3]
    assert load_config(None, FAST).run.unseen_ids(5) == []


@pytest.mark.parametrize("name", ["fedamp", "apple", "fedfomo", "local", "sosicfl", "fedamp+ala"])
def test_methods_without_a_model_for_a_newcomer_are_refused_naming_the_method(name):
    with pytest.raises(
        ConfigError, match=re.escape(f"algorithm {name!r} has no model for a client that never trained")
    ):
        load_config(None, [*FAST, f'algorithms=["fedavg", "{name}"]', "unseen_clients=1"])
    load_config(None, [*FAST, f'algorithms=["{name}"]'])  # without unseen clients it runs


# ---- they never train --------------------------------------------------------------------------
def test_unseen_clients_never_train_or_upload(monkeypatch):
    setup, _, session = unseen_session("fedavg", unseen=(1, 3), rounds=3)
    alg = setup.algorithm
    trained, uploaded = [], []
    local_train, add = alg.local_train, WeightedAverage.add
    monkeypatch.setattr(alg, "local_train", lambda p, s, ctx: trained.append(ctx.client_id) or local_train(p, s, ctx))
    monkeypatch.setattr(WeightedAverage, "add", lambda self, u: uploaded.append(u["client_id"]) or add(self, u))
    session.run(on_engine(LoopEngine(), setup))
    assert set(trained) == set(uploaded) == {0, 2, 4} and len(trained) == 9
    assert sorted(session.state.clients.keys()) == [0, 2, 4]  # no state is kept for them
    history = session.state.history
    assert all(r["evaluated_clients"] == 3 and r["unseen_evaluated_clients"] == 2 for r in history)
    assert set(history[-1]["unseen_client_accuracy"]) == {"1", "3"}


def test_prepare_sees_the_participants_only():
    """SCAFFOLD's client count (its control variate's 1/N) and the stored states: participants only."""
    setup, init, session = unseen_session("scaffold", unseen=(0, 2))
    assert session.state.server["num_clients"] == 3
    assert sorted(session.state.clients.keys()) == [1, 3, 4]


def test_sampling_draws_participants_only_with_the_join_ratio_over_them():
    _, _, session = unseen_session("fedavg", unseen=(0, 3), join_ratio=0.7)
    drawn = [session.driver.sample(t) for t in range(1, 40)]
    assert all(len(d) == 2 and set(d) <= {1, 2, 4} for d in drawn)  # floor(0.7 * 3) of the three
    assert {c for d in drawn for c in d} == {1, 2, 4}


# ---- how they are scored -----------------------------------------------------------------------
def pooled(setup, params, clients):
    scores = [
        evaluate(setup.model, params, setup.data.client(c).test_x, setup.data.client(c).test_y, 64) for c in clients
    ]
    total = sum(s["num_samples"] for s in scores)
    return sum(s["correct"] for s in scores) / total, sum(s["loss_sum"] for s in scores) / total


def test_fedavg_unseen_accuracy_without_finetuning_is_the_global_models_on_those_clients():
    setup, init, session = unseen_session("fedavg", unseen=(1, 3), finetune=0)
    session.run(on_engine(LoopEngine(), setup))
    first, last = session.state.history[0], session.state.history[-1]
    assert (first["unseen_accuracy"], first["unseen_loss"]) == pytest.approx(pooled(setup, init, (1, 3)))
    final = pooled(setup, session.state.server["global"], (1, 3))
    assert (last["unseen_accuracy"], last["unseen_loss"]) == pytest.approx(final, rel=1e-6)


def test_finetuning_changes_the_newcomers_scores_and_nothing_else():
    plain = unseen_records("fedavg", LoopEngine(), finetune=0)
    tuned = unseen_records("fedavg", LoopEngine(), finetune=2)
    assert [r["unseen_loss"] for r in tuned] != pytest.approx([r["unseen_loss"] for r in plain])
    assert tuned[-1]["unseen_loss"] < plain[-1]["unseen_loss"]  # two epochs on their own data
    for a, b in zip(plain, tuned):
        assert {k: v for k, v in a.items() if "unseen" not in k and "seconds" not in k} == {
            k: v for k, v in b.items() if "unseen" not in k and "seconds" not in k
        }


def test_a_budget_in_steps_takes_that_many_batches_of_the_same_stream():
    """Client 1 holds 45 samples: 4 full batches of 10 an epoch. Four steps are its one epoch; five
    run into a second epoch; two stop inside the first."""

    def unseen_losses(**budget):
        return [r["unseen_loss"] for r in unseen_records("fedavg", LoopEngine(), unseen=(1,), **budget)]

    one_epoch = unseen_losses(finetune=1)
    assert unseen_losses(finetune_steps=4) == one_epoch
    five, two, none = unseen_losses(finetune_steps=5), unseen_losses(finetune_steps=2), unseen_losses()
    assert len({tuple(x) for x in (one_epoch, five, two, none)}) == 4
    for engine in (ParallelEngine(2), VmapEngine(2)):
        other = [r["unseen_loss"] for r in unseen_records("fedavg", engine, unseen=(1,), finetune_steps=5)]
        assert other == pytest.approx(five, rel=1e-4)
        engine.close()


def test_a_finetuning_lr_changes_the_newcomers_only_and_the_runs_lr_changes_nothing():
    setup, _, _ = unseen_session("fedavg")
    default = unseen_records("fedavg", LoopEngine(), finetune=1)
    same = unseen_records("fedavg", LoopEngine(), finetune=1, finetune_lr=setup.train.lr)
    assert [{k: v for k, v in r.items() if "seconds" not in k} for r in same] == [
        {k: v for k, v in r.items() if "seconds" not in k} for r in default
    ]
    slow = unseen_records("fedavg", LoopEngine(), finetune=1, finetune_lr=setup.train.lr / 10)
    assert [r["unseen_loss"] for r in slow] != pytest.approx([r["unseen_loss"] for r in default])
    for a, b in zip(default, slow, strict=True):
        assert {k: v for k, v in a.items() if "unseen" not in k and "seconds" not in k} == {
            k: v for k, v in b.items() if "unseen" not in k and "seconds" not in k
        }
    for engine in (ParallelEngine(2), VmapEngine(2)):
        other = unseen_records("fedavg", engine, finetune=1, finetune_lr=setup.train.lr / 10)
        assert [r["unseen_loss"] for r in other] == pytest.approx([r["unseen_loss"] for r in slow], rel=1e-4)
        engine.close()
    assert load_config(None, [*FAST, "unseen_clients=1", "unseen_finetune_lr=0.01"]).run.unseen_finetune_lr == 0.01
    with pytest.raises(ConfigError, match="unseen_finetune_lr"):
        load_config(None, [*FAST, "unseen_clients=1", "unseen_finetune_lr=0"])


def test_the_finetuning_budget_is_in_epochs_or_in_steps_not_both():
    assert load_config(None, [*FAST, "unseen_clients=1", "unseen_finetune_steps=3"]).run.unseen_finetune_steps == 3
    with pytest.raises(ConfigError, match="set one of the two"):
        load_config(None, [*FAST, "unseen_clients=1", "unseen_finetune_steps=3", "unseen_finetune_epochs=1"])
    with pytest.raises(ConfigError, match="unseen_finetune_steps"):
        load_config(None, [*FAST, "unseen_clients=1", "unseen_finetune_steps=0"])


def test_ditto_and_pfedme_newcomers_start_their_personal_model_from_the_received_global():
    for name in ("ditto", "pfedme"):
        setup, init, session = unseen_session(name, unseen=(1,), finetune=0)
        session.run(on_engine(LoopEngine(), setup))
        last = session.state.history[-1]
        final = pooled(setup, setup.algorithm.global_params(session.state.server), (1,))
        assert (last["unseen_accuracy"], last["unseen_loss"]) == pytest.approx(final, rel=1e-6), name


# ---- engines, resume, Flower -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fedavg", "fedala", "ditto", "fedrep", "pfedme", "fedpac"])
def test_engines_agree_on_the_newcomers(name):
    loop = unseen_records(name, LoopEngine(), finetune=1)
    for engine in (ParallelEngine(2), VmapEngine(2)):
        other = unseen_records(name, engine, finetune=1)
        for a, b in zip(loop, other):
            assert b["unseen_accuracy"] == pytest.approx(a["unseen_accuracy"], abs=1e-9)
            assert b["unseen_loss"] == pytest.approx(a["unseen_loss"], rel=1e-4)
        engine.close()


@pytest.mark.integration
def test_a_resumed_run_records_the_newcomers_as_an_uninterrupted_one(tmp_path):
    cfg = load_config(
        None,
        [*FAST, "rounds=3", 'algorithms=["fedavg", "fedala"]', "unseen_clients=[0, 3]", "unseen_finetune_epochs=1"],
    )
    whole = run_experiment(cfg, tmp_path / "whole", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            cfg, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("fedala", 1)]
        )
    resumed = resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    assert records_without_timings(tmp_path / "cut") == records_without_timings(tmp_path / "whole")
    for name in ("fedavg", "fedala"):
        assert resumed[name]["best_unseen_accuracy"] == whole[name]["best_unseen_accuracy"]
        assert whole[name]["final_unseen_accuracy"] <= whole[name]["best_unseen_accuracy"]
    assert "best unseen acc %" in format_table(whole)
    saved = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert "final_unseen_accuracy" in saved["fedala"]


@pytest.mark.integration
@pytest.mark.flower
@pytest.mark.parametrize(
    "budget",
    ["unseen_finetune_epochs=1", "unseen_finetune_steps=3", "unseen_finetune_epochs=1 unseen_finetune_lr=0.01"],
)
def test_flower_in_process_scores_the_newcomers_as_the_simulator(tmp_path, budget):
    pytest.importorskip("flwr")
    from tests.flower.test_flower import OVERRIDES, assert_same_records, run_both

    config = load_config(
        None, [*OVERRIDES, 'algorithms=["fedavg", "fedala", "ditto"]', "unseen_clients=[1]", *budget.split()]
    )
    flower_records, sim_records = run_both(tmp_path, config)
    assert len(flower_records) == len(sim_records) == 4 * 3
    assert all(r["unseen_evaluated_clients"] == 1 and r["evaluated_clients"] == 2 for r in flower_records)
    assert_same_records(flower_records, sim_records)


@pytest.mark.parametrize("name", by_method(available()))
def test_every_method_scores_newcomers_or_is_refused(name):
    """A method either gives newcomers a model (finite scores, round 0 and the last) or says why not."""
    if method_class(name).newcomer_refusal is not None:
        with pytest.raises(ConfigError, match="has no model for a client that never trained"):
            load_config(None, [*FAST, f'algorithms=["{name}"]', "unseen_clients=1"])
        return
    setup, _, session = unseen_session(name, unseen=(2,), finetune=1, rounds=1)
    history = session.run(on_engine(LoopEngine(), setup)).history
    assert [r["unseen_evaluated_clients"] for r in history] == [1, 1]
    assert all(np.isfinite(r["unseen_loss"]) and 0 <= r["unseen_accuracy"] <= 1 for r in history)

"""Unreliable clients: seeded dropout and stragglers, their records, engines, resume and the server
rules of SCAFFOLD and FedNova with a missing upload or a short client."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pflkit.algorithms import ClientSummary, TrainBatches, TrainSettings
from pflkit.algorithms.scaffold import CONTROL, CONTROL_DELTA
from pflkit.config import ConfigError, load_config
from pflkit.engines import LoopEngine, ParallelEngine, VmapEngine
from pflkit.engines.batched import BatchedClientContext
from pflkit.engines.plan import ClientPlan, step_cap
from pflkit.federation import RoundDriver, RunSession
from pflkit.federation.reliability import Reliability
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.run.test_resume_server_optimizers import InterruptEach
from tests.support.builders import make_data, setup_for
from tests.support.runs import records_without_timings

SIZES = [30, 20, 50, 10]  # batches of 10: 3, 2, 5 and 1 steps per epoch


def driver_for(setup, rule: Reliability | None, rounds: int = 2, join_ratio: float = 1.0) -> RoundDriver:
    return RoundDriver(
        setup.algorithm,
        num_clients=setup.data.num_clients,
        seed=setup.seed,
        rounds=rounds,
        join_ratio=join_ratio,
        eval_every=1,
        reliability=rule,
    )


def summaries(data) -> list[ClientSummary]:
    return [ClientSummary(i, data.client(i).num_train, data.train_label_counts(i)) for i in range(data.num_clients)]


def clone(params: dict) -> dict:
    return {k: v.detach().clone() for k, v in params.items()}


# ---- the draws ---------------------------------------------------------------------------------
def test_drops_and_stragglers_are_draws_of_seed_round_and_client_alone():
    rule = Reliability(dropout_rate=0.3, straggler_rate=0.4, straggler_work=0.5)
    everyone = list(range(200))
    dropped = rule.dropped(7, 3, everyone)
    assert dropped == rule.dropped(7, 3, everyone)  # reproducible
    assert dropped != rule.dropped(8, 3, everyone) and dropped != rule.dropped(7, 4, everyone)
    # a client's fate does not depend on who else was selected (so join_ratio and engines agree)
    assert [c for c in everyone if rule.dropped(7, 3, [c])] == dropped
    draws = [c for r in range(1, 21) for c in rule.dropped(0, r, everyone)]
    assert len(draws) / 4000 == pytest.approx(0.3, abs=0.03)
    stragglers = [rule.work(0, r, c) for r in range(1, 21) for c in everyone]
    assert set(stragglers) == {0.5, 1.0}
    assert stragglers.count(0.5) / 4000 == pytest.approx(0.4, abs=0.03)


def test_a_schedule_drops_the_named_clients_when_they_are_selected():
    rule = Reliability.of(dropout_schedule=[[2, 1], [2, 3], [4, 0]])
    assert rule is not None
    assert rule.dropped(0, 2, [0, 1, 2, 3]) == [1, 3]
    assert rule.dropped(0, 2, [0, 2]) == []
    assert rule.dropped(0, 1, [0, 1, 2, 3]) == []
    assert Reliability.of() is None
    assert Reliability.of(straggler_rate=0.5, straggler_work=1.0) is None  # a straggler doing all its work


def test_step_cap_rounds_down_and_keeps_one_step():
    assert step_cap(10, 1.0) is None
    assert step_cap(10, 0.5) == 5
    assert step_cap(10, 0.29) == 2
    assert step_cap(100, 0.29) == 29  # 0.29 * 100 is 28.999999999999996 in floats
    assert step_cap(3, 0.1) == 1


# ---- the round deadline -----------------------------------------------------------------------------
PLANNED = {0: 3, 1: 2, 2: 5, 3: 1}  # SIZES' batches of 10, one local epoch


def test_a_deadline_cuts_each_client_to_the_steps_its_speed_allows():
    rule = Reliability.of(round_deadline=2.5, planned_steps=PLANNED)  # every speed 1: two steps done
    assert [rule.work(0, 1, c) for c in range(4)] == [2 / 3, 1.0, 2 / 5, 1.0]
    assert rule.dropped(0, 1, [0, 1, 2, 3]) == []
    late = Reliability.of(round_deadline=2.5, drop_late=True, planned_steps=PLANNED)
    assert late.dropped(0, 1, [0, 1, 2, 3]) == [0, 2] and late.dropped(0, 1, [1, 3]) == []
    # less than one step's time still completes one step (partial), or drops (drop)
    short = Reliability.of(round_deadline=0.2, planned_steps=PLANNED)
    assert [short.work(0, 1, c) for c in range(4)] == [1 / 3, 1 / 2, 1 / 5, 1.0]
    # with stragglers too, a client takes the smaller share
    both = Reliability.of(straggler_rate=1.0, straggler_work=0.5, round_deadline=2.5, planned_steps=PLANNED)
    assert [both.work(0, 1, c) for c in range(4)] == [0.5, 0.5, 2 / 5, 0.5]
    assert Reliability.of(round_deadline=None, planned_steps=PLANNED) is None


def test_the_share_a_deadline_leaves_gives_exactly_the_steps_completed():
    for planned in range(1, 120):
        for done in range(1, planned + 1):
            assert step_cap(planned, done / planned) in (done, None)


def test_client_speeds_are_log_normal_draws_of_seed_and_client_alone():
    rule = Reliability.of(round_deadline=4.0, speed_spread=0.5, planned_steps={c: 8 for c in range(2000)})
    speeds = [rule.speed(3, c) for c in range(2000)]
    assert speeds == [rule.speed(3, c) for c in range(2000)] and speeds != [rule.speed(4, c) for c in range(2000)]
    logs = [math.log(v) for v in speeds]
    assert sorted(logs)[1000] == pytest.approx(0, abs=0.05)  # median speed 1
    assert (sum(x * x for x in logs) / 2000) ** 0.5 == pytest.approx(0.5, abs=0.03)
    # the same client works alike in every round: a device keeps its speed
    assert {rule.work(3, r, 7) for r in range(1, 6)} == {min(1.0, math.floor(4.0 * speeds[7]) / 8)}
    assert Reliability.of(round_deadline=4.0, planned_steps={0: 8}).speed(3, 0) == 1.0


def test_a_run_with_a_deadline_records_who_it_cut_short_or_dropped(tmp_path, fast_config):
    """Synthetic clients of a 4-client run plan local_epochs x their batches (16 to 21 here); a
    deadline of 17.5 steps (17 done at speed 1) cuts exactly those that plan more."""
    base = [*fast_config, "dataset=synthetic", "num_clients=4", "rounds=2", 'algorithms=["fedavg"]']
    base += ["batch_size=10", "run.round_deadline=17.5"]
    config = load_config(None, base)
    from pflkit.federation.preparation import build_partitions

    _, parts = build_partitions(config, torch.device("cpu"))
    over = sum(1 for c in parts[config.seeds[0]].clients if c.num_train // 10 > 17)
    assert 0 < over < 4
    for policy, field in (("partial", "straggler_clients"), ("drop", "dropped_clients")):
        config = load_config(None, [*base, f'run.deadline_policy="{policy}"'])
        run_experiment(config, tmp_path / policy, progress=False, echo=lambda s: None)
        records = [json.loads(line) for line in (tmp_path / policy / "metrics.jsonl").read_text().splitlines()]
        assert [r[field] for r in records if "train_round" in r] == [over, over], policy


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.dropout_rate=1.0", "no round could aggregate"),
        ("run.dropout_rate=-0.1", ">= 0"),
        ("run.straggler_rate=1.5", "<= 1"),
        ("run.straggler_work=0.0", "> 0"),
        ("run.dropout_schedule=[[1, 4]]", r"names client 4 in round 1, but the run has clients 0\.\.3"),
        ("run.dropout_schedule=[[3, 0]]", r"rounds 1\.\.2"),
        ("run.dropout_schedule=[[1]]", r"\[round, client\] pairs"),
        ("run.min_replies=0", ">= 1"),
        ("run.round_deadline=0", "> 0"),
        ("run.client_speed_spread=0.5", "client_speed_spread = 0.5 has no effect without round_deadline"),
        ('run.deadline_policy="drop"', "deadline_policy = 'drop' has no effect without round_deadline"),
        ('run.deadline_policy="late"', "'partial' or 'drop'"),
        ("run.reply_timeout=0", "> 0"),
    ],
)
def test_bad_reliability_settings_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["dataset=synthetic", "num_clients=4", "rounds=2", override])


@pytest.mark.parametrize(
    "override",
    [
        ("run.dropout_rate=0.2",),
        ("run.dropout_schedule=[[1, 0]]",),
        ("run.tolerate_failures=true",),
        ("run.round_deadline=2", 'run.deadline_policy="drop"'),
    ],
)
def test_methods_that_need_every_upload_refuse_dropout_in_one_line(override):
    with pytest.raises(ConfigError) as info:
        load_config(
            None, ["dataset=synthetic", "num_clients=4", "rounds=2", 'algorithms=["fedavg", "fedamp"]', *override]
        )
    key = override[-1].split("=")[0]
    assert f"algorithm 'fedamp' needs every client's upload in every round: it cannot run with {key}" in str(info.value)
    # stragglers still upload, and so do clients a deadline cuts short: allowed
    load_config(None, ["dataset=synthetic", "num_clients=4", 'algorithms=["fedamp"]', "run.straggler_rate=0.5"])
    load_config(None, ["dataset=synthetic", "num_clients=4", 'algorithms=["fedamp"]', "run.round_deadline=2"])


def test_config_keys_describe_the_reliability_settings():
    from pflkit.config.sections import RunSettings

    for key in (
        "dropout_rate",
        "dropout_schedule",
        "straggler_rate",
        "straggler_work",
        "tolerate_failures",
        "round_deadline",
        "client_speed_spread",
        "deadline_policy",
        "reply_timeout",
    ):
        assert RunSettings.model_fields[key].description


# ---- stragglers in both contexts ------------------------------------------------------------------
def test_a_straggler_takes_the_first_share_of_its_planned_steps_in_both_contexts():
    train = TrainSettings(batch_size=10, local_epochs=2, lr=0.05)
    full = ClientPlan(TrainBatches(epochs=2), 50, train, 0, 1, 0)
    half = ClientPlan(TrainBatches(epochs=2), 50, train, 0, 1, 0, work=0.5)
    first, second = [full.next_epoch() for _ in range(2)], [half.next_epoch() for _ in range(2)]
    assert [len(e) for e in first] == [5, 5] and [len(e) for e in second] == [5, 0]
    assert all(torch.equal(a.index(), b.index()) for a, b in zip(first[0], second[0]))
    capped = ClientPlan(TrainBatches(epochs=2, max_steps=4), 50, train, 0, 1, 0, work=0.5)
    assert sum(len(capped.next_epoch()) for _ in range(2)) == 2

    data = make_data(SIZES)
    setup, init = setup_for("fedavg", data)
    work = {0: 0.5, 2: 0.3}
    single = [setup.context(i, 1) for i in range(4)]
    batched = BatchedClientContext(list(range(4)), 1, setup.seed, data, setup.model, setup.units, setup.train)
    batched.work = work
    loss = setup.algorithm.loss()
    fits = []
    for ctx in single:
        ctx.work = work
        fits.append(ctx.fit(init, loss))
    stacked = {k: v.expand(4, *v.shape).clone() for k, v in init.items()}
    together = batched.fit(stacked, loss)
    assert [int(f.steps) for f in fits] == [1, 2, 1, 1]  # 3 * 0.5 -> 1, 2, 5 * 0.3 -> 1, 1
    assert together.steps.tolist() == [1, 2, 1, 1]
    for k, f in enumerate(fits):
        for name, value in f.params.items():
            torch.testing.assert_close(together.params[name][k], value, atol=1e-5, rtol=1e-5)


# ---- rounds ---------------------------------------------------------------------------------------
def test_scaffold_with_a_dropped_client_and_stragglers_follows_algorithm_1():
    """c <- c + (1/N) sum over the clients that returned of delta c_i; x <- x + eta_g mean(y - x) over
    them; the dropped clients' c_i stay as they were; K_i is each client's own (short) step count."""
    data = make_data(SIZES)
    setup, init = setup_for("scaffold", data)
    rule = Reliability.of(dropout_schedule=[[1, 1], [1, 3]], straggler_rate=1.0, straggler_work=0.5)
    driver = driver_for(setup, rule)
    state = driver.start(init, summaries(data))
    state.server[CONTROL] = {k: 0.01 * torch.randn_like(v) for k, v in state.server[CONTROL].items()}
    before = {cid: clone(state.clients[cid][CONTROL]) for cid in range(4)}
    x, c = clone(state.server["global"]), clone(state.server[CONTROL])
    plan = driver.plan(state, 1)
    assert [j.client_id for j in plan.jobs] == [0, 2] and plan.dropped == [1, 3]
    results = LoopEngine().run(setup, plan.jobs, 1)
    assert [r.metrics["local_steps"] for r in results] == [1, 2]  # 3 and 5 steps, halved, rounded down
    driver.finish(state, plan, results)
    for k in c:
        delta = sum(r.upload[CONTROL_DELTA][k] for r in results)
        torch.testing.assert_close(state.server[CONTROL][k], c[k] + delta / 4)
        mean_y = sum(r.upload["params"][k] for r in results) / 2
        torch.testing.assert_close(state.server["global"][k], x[k] + 1.0 * (mean_y - x[k]))
        assert torch.isfinite(state.server[CONTROL][k]).all()
    for cid in (1, 3):
        for k, v in before[cid].items():
            assert torch.equal(state.clients[cid][CONTROL][k], v)
    assert not all(torch.equal(state.clients[0][CONTROL][k], v) for k, v in before[0].items())
    record = state.pending
    assert record is not None
    assert (record["dropped_clients"], record["straggler_clients"]) == (2, 2)


def test_fednova_normalises_a_stragglers_update_by_the_steps_it_took():
    data = make_data(SIZES)
    setup, init = setup_for("fednova", data)
    driver = driver_for(setup, Reliability.of(dropout_schedule=[[1, 3]], straggler_rate=0.5, straggler_work=0.5))
    state = driver.start(init, summaries(data))
    old = clone(state.server["global"])
    plan = driver.plan(state, 1)
    works = {j.client_id: j.work for j in plan.jobs}
    assert set(works.values()) == {0.5, 1.0}  # at this seed both kinds of client train
    results = LoopEngine().run(setup, plan.jobs, 1)
    full = {0: 3, 1: 2, 2: 5}
    for r in results:
        expected = full[r.client_id] if works[r.client_id] == 1 else step_cap(full[r.client_id], 0.5)
        assert r.metrics["local_steps"] == expected == float(r.upload["normaliser"])
    driver.finish(state, plan, results)
    n = torch.tensor([float(r.upload["num_samples"]) for r in results], dtype=torch.float64)
    p = n / n.sum()
    a = torch.tensor([float(r.upload["normaliser"]) for r in results], dtype=torch.float64)
    tau_eff = float((p * a).sum())
    names = set(setup.algorithm.parameter_names)
    for k in names:
        direction = sum(float(pm) * r.upload["params"][k] for pm, r in zip(p, results))
        torch.testing.assert_close(state.server["global"][k], old[k] - tau_eff * direction)


def test_a_round_whose_clients_all_dropped_keeps_the_server_state_and_says_so():
    data = make_data(SIZES)
    setup, init = setup_for("fedavg", data)
    driver = driver_for(setup, Reliability.of(dropout_schedule=[[1, c] for c in range(4)]))
    session = RunSession.open(driver, init, summaries(data))
    before = clone(session.state.server["global"])
    session.step(lambda jobs, round: LoopEngine().run(setup, jobs, round))  # round 1 (evaluates round 0)
    assert session.state.rounds_done == 1
    for k, v in before.items():
        assert torch.equal(session.state.server["global"][k], v)
    record = session.step(lambda jobs, round: LoopEngine().run(setup, jobs, round))  # records round 1
    assert record is not None
    assert record["aggregation_skipped"] is True and record["dropped_clients"] == 4
    assert math.isnan(record["train_loss"])


def test_with_every_client_evaluated_the_dropped_clients_are_scored_too():
    """``eval_all_clients``: a client that drops out of a round still holds its model, and the round's
    evaluation scores it as it scores the clients that were not selected."""
    data = make_data(SIZES)
    setup, init = setup_for("fedavg", data)
    driver = RoundDriver(
        setup.algorithm,
        num_clients=4,
        seed=setup.seed,
        rounds=3,
        join_ratio=1.0,
        eval_every=1,
        evaluate_all=True,
        reliability=Reliability.of(dropout_schedule=[[2, 1], [2, 3], [3, 0], [3, 1], [3, 2], [3, 3]]),
    )
    session = RunSession.open(driver, init, summaries(data))
    records = session.run(lambda jobs, round: LoopEngine().run(setup, jobs, round)).history
    assert [r["evaluated_clients"] for r in records] == [4, 4, 4, 4]
    assert [r.get("dropped_clients") for r in records[1:]] == [0, 2, 4]


def run_with(engine, rounds: int = 3):
    data = make_data(SIZES + [40, 25])
    setup, init = setup_for("scaffold", data)
    rule = Reliability.of(dropout_rate=0.3, straggler_rate=0.5, straggler_work=0.4)
    session = RunSession.open(driver_for(setup, rule, rounds, join_ratio=0.7), init, summaries(data))
    return session.run(lambda jobs, round: engine.run(setup, jobs, round))


def test_every_engine_drops_and_shortens_the_same_clients_to_the_same_numbers():
    reference = run_with(LoopEngine())
    assert sum(r.get("dropped_clients", 0) for r in reference.history) > 0
    assert sum(r.get("straggler_clients", 0) for r in reference.history) > 0
    for engine in (ParallelEngine(2), VmapEngine(chunk_size=3)):
        try:
            other = run_with(engine)
        finally:
            engine.close()
        for k, v in reference.server["global"].items():
            torch.testing.assert_close(other.server["global"][k], v, atol=1e-5, rtol=1e-5)
        for a, b in zip(reference.history, other.history, strict=True):
            assert {k: a.get(k) for k in ("dropped_clients", "straggler_clients", "evaluated_clients")} == {
                k: b.get(k) for k in ("dropped_clients", "straggler_clients", "evaluated_clients")
            }


@pytest.mark.integration
def test_a_run_with_dropout_resumed_mid_run_equals_the_uninterrupted_run(tmp_path, fast_config):
    overrides = [
        'algorithms=["fedavg", "scaffold"]',
        "rounds=4",
        "run.dropout_rate=0.3",
        "run.dropout_schedule=[[2, 1]]",
        "run.straggler_rate=0.5",
    ]
    cfg = load_config(None, fast_config + overrides)
    quiet = {"progress": False, "echo": lambda s: None}
    run_experiment(cfg, tmp_path / "full", **quiet)
    interrupt = InterruptEach(3)
    with pytest.raises(KeyboardInterrupt):  # inside fedavg's run
        run_experiment(cfg, tmp_path / "cut", callbacks=[interrupt], **quiet)
    with pytest.raises(KeyboardInterrupt):  # inside scaffold's run
        resume_experiment(tmp_path / "cut", callbacks=[interrupt], **quiet)
    resume_experiment(tmp_path / "cut", callbacks=[interrupt], **quiet)
    assert interrupt.done == {"fedavg", "scaffold"}
    full = records_without_timings(tmp_path / "full")
    assert records_without_timings(tmp_path / "cut") == full
    trained = [r for r in full if "train_round" in r]
    assert all("dropped_clients" in r and "straggler_clients" in r for r in trained)
    assert sum(r["dropped_clients"] for r in trained) > 0
    assert all(math.isfinite(r["train_loss"]) for r in trained if not r.get("aggregation_skipped"))


@pytest.mark.integration
def test_the_unreliable_digits_config_runs_and_records_drops_and_late_clients(tmp_path):
    from click.testing import CliRunner

    from pflkit.cli import main
    from tests.support.paths import REPO

    out = tmp_path / "run"
    config = str(REPO / "configs" / "unreliable-digits.toml")
    result = CliRunner().invoke(main, ["run", config, "rounds=3", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    trained = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in trained if "train_round" in r]
    assert {r["algorithm"] for r in trained} == {"fedavg", "fedprox", "fednova", "scaffold"}
    assert all(r["dropped_clients"] + r["straggler_clients"] > 0 for r in trained)
    by_method = {}
    for r in trained:
        by_method.setdefault(r["algorithm"], []).append((r["dropped_clients"], r["straggler_clients"]))
    assert len(set(map(tuple, by_method.values()))) == 1  # every method sees the same unreliable clients

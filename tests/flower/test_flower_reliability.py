"""Unreliable clients on Flower: the seeded dropout and stragglers give the simulator's records, and
with ``tolerate_failures`` a client that fails or does not reply counts as dropped."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flwr")

from flwr.app import MessageType

from pflkit.config import load_config
from pflkit.flower.client_app import app as client_app
from pflkit.flower.local import LocalGrid
from pflkit.flower.server import run_on_flower
from pflkit.run.experiment import run_experiment
from tests.flower.test_flower import OVERRIDES, _OneClientFails, assert_same_records, run_both

pytestmark = [pytest.mark.integration, pytest.mark.flower]

UNRELIABLE = ["run.dropout_rate=0.3", "run.dropout_schedule=[[2, 0], [2, 1], [2, 2]]", "run.straggler_rate=0.5"]


def test_seeded_dropout_and_stragglers_on_flower_match_the_simulator(tmp_path):
    config = load_config(None, OVERRIDES + UNRELIABLE + ['algorithms=["fedavg", "scaffold", "fednova", "ditto"]'])
    flower, sim = run_both(tmp_path, config)
    assert len(flower) == len(sim) == 16
    assert_same_records(flower, sim)
    trained = [r for r in sim if "train_round" in r]
    assert sum(r["dropped_clients"] for r in trained) > 3 and sum(r["straggler_clients"] for r in trained) > 0
    assert all(r.get("aggregation_skipped") for r in trained if r["train_round"] == 2)  # everyone dropped


@pytest.mark.parametrize("policy, field", [("partial", "straggler_clients"), ("drop", "dropped_clients")])
def test_a_round_deadline_on_flower_matches_the_simulator(tmp_path, policy, field):
    deadline = ["run.round_deadline=2", "run.client_speed_spread=0.8", f'run.deadline_policy="{policy}"']
    config = load_config(None, OVERRIDES + deadline + ['algorithms=["fedavg", "fednova"]'])
    flower, sim = run_both(tmp_path, config)
    assert_same_records(flower, sim)
    assert sum(r[field] for r in sim if "train_round" in r) > 0


class _OneClientSilent(LocalGrid):
    """Node 1002 (client 2) never answers its training messages (a SuperNode that went away)."""

    def push_messages(self, messages):
        ids = []
        for message in messages:
            if message.metadata.dst_node_id == 1002 and message.metadata.message_type == MessageType.TRAIN:
                message.metadata.__dict__["_message_id"] = f"lost-{len(ids)}"
                ids.append(message.metadata.message_id)
            else:
                ids += list(super().push_messages([message]))
        return ids


@pytest.mark.parametrize("grid_class", [_OneClientFails, _OneClientSilent])
def test_with_tolerate_failures_a_failed_or_silent_client_counts_as_dropped(tmp_path, grid_class):
    settings = ["run.tolerate_failures=true", "run.reply_timeout=2", 'algorithms=["fedavg", "scaffold"]']
    config = load_config(None, OVERRIDES + settings)
    grid = grid_class(client_app, [{"partition-id": i} for i in range(3)])
    run_on_flower(config, grid, tmp_path / "out", wait_seconds=5)  # a silent client: reply_timeout, 2 s a round
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train_round" in r]
    assert [r["dropped_clients"] for r in trained] == [1, 1, 1] * 2
    # the lost replies carried client 1's evaluations too; the final pass reaches every client
    assert [r["evaluated_clients"] for r in records] == [2, 2, 2, 3] * 2


class _RepliesLost(LocalGrid):
    """Node 1002 (client 2) trains in rounds 1 and 2 and saves its state, but its replies are lost."""

    def push_messages(self, messages):
        ids = []
        for message in messages:
            meta = message.metadata
            if meta.dst_node_id == 1002 and meta.message_type == MessageType.TRAIN and meta.group_id in ("1", "2"):
                meta.__dict__["_message_id"] = f"lost-{meta.group_id}"
                self.client_app(message, self.contexts[meta.dst_node_id])  # trained; the reply goes nowhere
                ids.append(meta.message_id)
            else:
                ids += list(super().push_messages([message]))
        return ids


@pytest.mark.parametrize("saved", [False, True])
def test_a_node_whose_reply_was_lost_goes_on_as_the_simulators_dropped_client(tmp_path, saved):
    """SCAFFOLD's c_i and Ditto's personal model of a node whose trained reply never arrived are
    rolled back, so the run equals the simulator's with that client dropped in those rounds (nodes
    keeping their states in memory, or ``saved`` in their state-dir files too)."""
    overrides = OVERRIDES + ['algorithms=["scaffold", "ditto"]']
    flower_config = load_config(None, overrides + ["run.tolerate_failures=true", "run.reply_timeout=0.5"])
    nodes = [{"partition-id": i, **({"state-dir": str(tmp_path / f"node{i}")} if saved else {})} for i in range(3)]
    run_on_flower(flower_config, _RepliesLost(client_app, nodes), tmp_path / "flower", wait_seconds=5)
    dropped = load_config(None, overrides + ["run.dropout_schedule=[[1, 2], [2, 2]]"])
    run_experiment(dropped, tmp_path / "sim", progress=False, echo=lambda s: None)

    def records(folder):
        lines = (tmp_path / folder / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if "seconds" not in k} for line in lines]

    flower, sim = records("flower"), records("sim")
    assert [r.pop("lost_replies", None) for r in flower] == [None, [2], [2], None] * 2
    # the lost client's download was sent; the simulator's dropped client got none
    sent = [(f.pop("down_bytes", 0), s.pop("down_bytes", 0)) for f, s in zip(flower, sim)]
    assert [f > s for f, s in sent] == [False, True, True, False] * 2
    for r in (*flower, *sim):
        r.pop("down_floats_per_client", None)
    assert_same_records(flower, sim)


def test_fewer_replies_than_min_replies_stop_the_run(tmp_path):
    config = load_config(None, OVERRIDES + ["run.tolerate_failures=true", "run.min_replies=3"])
    grid = _OneClientFails(client_app, [{"partition-id": i} for i in range(3)])
    with pytest.raises(
        RuntimeError, match=r"fedavg seed 0 round 1: 2 of 3 clients replied, fewer than min_replies = 3"
    ):
        run_on_flower(config, grid, tmp_path / "out", wait_seconds=5)


class _OneClientSilentAtSetup(LocalGrid):
    """Node 1002 (client 2) never answers the setup query (a node too slow to load its data)."""

    def push_messages(self, messages):
        ids = []
        for message in messages:
            if message.metadata.dst_node_id == 1002 and message.metadata.message_type == MessageType.QUERY:
                message.metadata.__dict__["_message_id"] = "lost-query"
                ids.append(message.metadata.message_id)
            else:
                ids += list(super().push_messages([message]))
        return ids


def test_a_node_that_does_not_answer_the_setup_query_is_named_as_a_timeout(tmp_path):
    config = load_config(None, OVERRIDES + ["run.reply_timeout=1"])
    grid = _OneClientSilentAtSetup(client_app, [{"partition-id": i} for i in range(3)])
    with pytest.raises(RuntimeError, match=r"only 2 of 3 SuperNodes answered the setup query within 1 s"):
        run_on_flower(config, grid, tmp_path / "out", wait_seconds=5)

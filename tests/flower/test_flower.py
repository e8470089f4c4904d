"""pflkit on Flower: the ClientApp called directly, and whole runs through Flower in-process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402

from pflkit.algorithms import ClientSummary  # noqa: E402
from pflkit.config import load_config, to_dict  # noqa: E402
from pflkit.engines import LoopEngine, RoundSetup  # noqa: E402
from pflkit.federation import RoundDriver  # noqa: E402
from pflkit.flower import serde  # noqa: E402
from pflkit.flower.client_app import app as client_app  # noqa: E402
from pflkit.flower.local import LocalGrid  # noqa: E402
from pflkit.flower.node import node_setup, state_key  # noqa: E402
from pflkit.flower.server import run_on_flower  # noqa: E402
from pflkit.run.experiment import run_experiment  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.flower]

OVERRIDES = [
    "dataset=synthetic",
    "num_clients=3",
    "alpha=0.5",
    "rounds=3",
    "fedala.max_start_epochs=4",
    "fedrep.head_epochs=1",
    "ditto.personal_epochs=1",
    "engine=loop",
]


def test_core_package_does_not_import_flower():
    code = (
        "import sys, pflkit, pflkit.cli, pflkit.run.experiment, pflkit.algorithms, pflkit.bench; "
        "assert 'flwr' not in sys.modules, 'flwr imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _message(config_text, name, seed, round, payload, node_id, evaluate=True, message_type=MessageType.TRAIN):
    content = RecordDict(
        {
            "pflkit": ConfigRecord(
                {"config": config_text, "algorithm": name, "seed": seed, "round": round, "evaluate": evaluate}
            )
        }
    )
    serde.put(content, "payload", payload)
    message = Message(content, dst_node_id=node_id, message_type=message_type, group_id=str(round))
    message.metadata.__dict__["_message_id"] = f"m{round}-{node_id}"
    return message


def test_client_app_called_directly_keeps_state_in_one_context_like_the_simulator(tmp_path):
    import tomli_w

    LocalGrid(client_app, [])  # sets Flower's process identity for message construction
    config = load_config(None, OVERRIDES)
    text = tomli_w.dumps(to_dict(config))
    # the simulator's run, client states kept round by round
    setup0 = node_setup(text, {"partition-id": 0}, 0)
    algorithm = setup0.algorithm(config, "fedala")
    setup = RoundSetup(algorithm, setup0.data, setup0.model, setup0.model.units(), setup0.train, 0)
    driver = RoundDriver(algorithm, num_clients=3, seed=0, rounds=3, join_ratio=1.0, eval_every=1)
    sim = driver.start(
        setup0.init,
        [ClientSummary(i, setup0.data.client(i).num_train, setup0.data.train_label_counts(i)) for i in range(3)],
    )
    contexts = {
        i: Context(
            run_id=1,
            node_id=10 + i,
            state=RecordDict(),
            run_config={},
            node_config={"partition-id": i, "state-dir": str(tmp_path / str(i))},
        )
        for i in range(3)
    }
    server = algorithm.init_server(setup0.init)
    key = state_key("fedala", 0)
    started = []
    for t in (1, 2, 3):
        uploads = []
        for i in range(3):
            reply = client_app(_message(text, "fedala", 0, t, algorithm.downlink(server, i, t), 10 + i), contexts[i])
            assert not reply.has_error(), reply.error
            uploads.append({**serde.get(reply.content, "upload"), "client_id": i})
            metrics = reply.content["metrics"]
            assert int(metrics["client-id"]) == i and "eval.correct" in metrics
        server = algorithm.aggregate(server, uploads, t)
        plan = driver.plan(sim, t)
        driver.finish(sim, plan, LoopEngine().run(setup, plan.jobs, t))
        state = serde.get(contexts[0].state, key)["versions"][0]["state"]
        started.append(state["ala"]["started"])
        for name, w in state["ala"]["weights"].items():  # ALA weights change exactly as in the simulator
            torch.testing.assert_close(w, sim.clients[0]["ala"]["weights"][name], rtol=0, atol=1e-6)
        for name, p in state["model"].items():
            torch.testing.assert_close(p, sim.clients[0]["model"][name], rtol=0, atol=1e-6)
    assert started == [False, True, True]  # inactive in round 1, start phase in round 2
    assert (tmp_path / "0" / f"{key}.pt").is_file()
    # a restarted node (fresh Context) continues from its saved state
    fresh = Context(run_id=1, node_id=10, node_config=contexts[0].node_config, state=RecordDict(), run_config={})
    again = client_app(_message(text, "fedala", 0, 4, algorithm.downlink(server, 0, 4), 10), fresh)
    same = client_app(_message(text, "fedala", 0, 4, algorithm.downlink(server, 0, 4), 10), contexts[0])
    a, b = serde.get(again.content, "upload")["params"], serde.get(same.content, "upload")["params"]
    for name in a:
        assert torch.equal(a[name], b[name])
    # round 4 sent again (a ServerApp restarted from its checkpoint): it starts from the state before round 4
    resent = client_app(_message(text, "fedala", 0, 4, algorithm.downlink(server, 0, 4), 10), contexts[0])
    c = serde.get(resent.content, "upload")["params"]
    assert all(torch.equal(a[name], c[name]) for name in a)
    assert [v["round"] for v in serde.get(contexts[0].state, key)["versions"]] == [4, 3]


def test_a_node_parses_each_config_text_once_and_builds_each_runs_algorithm_once(monkeypatch):
    """Every message of a run reuses the node's parsed config and built algorithm; another config
    text or algorithm gets its own."""
    import tomli_w

    from pflkit.config import build_config
    from pflkit.flower import node
    from pflkit.methods import build_algorithm

    LocalGrid(client_app, [])  # sets Flower's process identity for message construction
    parsed, built = [], []
    monkeypatch.setattr(
        node, "build_config", lambda data, source: parsed.append(data["name"]) or build_config(data, source)
    )
    monkeypatch.setattr(node, "build_algorithm", lambda name, *args: built.append(name) or build_algorithm(name, *args))
    texts = {n: tomli_w.dumps(to_dict(load_config(None, OVERRIDES + [f"name={n}"]))) for n in ("cache-a", "cache-b")}
    payload = {"global": node_setup(texts["cache-a"], {"partition-id": 0}, 0).init}

    def send(text, name, round, context, message_type=MessageType.TRAIN):
        reply = client_app(_message(text, name, 0, round, payload, 10, message_type=message_type), context)
        assert not reply.has_error(), reply.error

    def fresh_context():  # a new Flower run
        return Context(run_id=1, node_id=10, state=RecordDict(), run_config={}, node_config={"partition-id": 0})

    context = fresh_context()
    for t in (1, 2, 3):
        send(texts["cache-a"], "fedavg", t, context)
    send(texts["cache-a"], "fedavg", 4, context, MessageType.EVALUATE)
    assert (parsed, built) == (["cache-a"], ["fedavg"])
    send(texts["cache-a"], "fedala", 1, context)
    send(texts["cache-a"], "fedala", 2, context)
    assert (parsed, built) == (["cache-a"], ["fedavg", "fedala"])
    send(texts["cache-b"], "fedavg", 1, fresh_context())
    assert (parsed, built) == (["cache-a", "cache-b"], ["fedavg", "fedala", "fedavg"])
    send(texts["cache-a"], "fedavg", 4, context)  # the first run's entries are still cached
    assert (parsed, built) == (["cache-a", "cache-b"], ["fedavg", "fedala", "fedavg"])


def run_both(tmp_path, config) -> tuple[list[dict], list[dict]]:
    """The config's records on in-process Flower and in the simulator (timings left out)."""
    grid = LocalGrid(client_app, [{"partition-id": i, "num-partitions": 3} for i in range(3)])
    run_on_flower(config, grid, tmp_path / "flower", wait_seconds=5)
    run_experiment(config, tmp_path / "sim", progress=False, echo=lambda s: None)

    def records(folder):
        return [
            {k: v for k, v in json.loads(line).items() if "seconds" not in k}
            for line in (folder / "metrics.jsonl").read_text().splitlines()
        ]

    return records(tmp_path / "flower"), records(tmp_path / "sim")


def assert_same_records(flower_records: list[dict], sim_records: list[dict]) -> None:
    """Stated tolerance: 1e-9 (observed: identical)."""
    for f, s in zip(flower_records, sim_records):
        assert f.keys() == s.keys()
        for key in f:
            if isinstance(f[key], (float, list)):
                assert f[key] == pytest.approx(s[key], abs=1e-9, nan_ok=True), key
            else:
                assert f[key] == s[key], key


@pytest.mark.parametrize(
    "algorithms",
    [
        ["fedala"],
        ["fedavg", "ditto+ala", "fedrep"],
        ["fedfomo", "apple", "fedamp+ala", "pfedme", "partialfed"],
        ["fedper", "lgfedavg+ala"],
        ["fedavgm", "fedadagrad", "fedadam+ala", "fedyogi"],
        ["feddyn", "moon+ala"],
        ["apfl+ala", "fedbabu"],
        ["scaffold", "scaffold+ala"],
        ["fedproto", "fedgh+ala"],
        ["feddbe+ala", "fedcp"],
        ["fedcac+ala", "fedas"],
        ["fedpac", "fedpac+ala"],
        ["gpfl"],
    ],
)
def test_flower_run_in_process_matches_the_simulator(tmp_path, algorithms):
    config = load_config(None, OVERRIDES + [f"algorithms={json.dumps(algorithms)}"])
    flower_records, sim_records = run_both(tmp_path, config)
    assert len(flower_records) == len(sim_records) == 4 * len(algorithms)
    assert_same_records(flower_records, sim_records)
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert set(summary) == set(algorithms)
    assert (tmp_path / "flower" / "plots" / "accuracy.png").is_file()


def test_flower_runs_fedbn_with_its_batch_norm_model_as_the_simulator(tmp_path):
    config = load_config(None, OVERRIDES + ['algorithms=["fedbn", "fedbn+ala"]', 'model="fedbn_cnn"', "rounds=2"])
    flower_records, sim_records = run_both(tmp_path, config)
    assert len(flower_records) == len(sim_records) == 6
    assert_same_records(flower_records, sim_records)


def test_missing_partition_is_reported(tmp_path):
    config = load_config(None, OVERRIDES)
    grid = LocalGrid(client_app, [{"partition-id": 0}, {"partition-id": 1}, {"partition-id": 1}])
    with pytest.raises(RuntimeError, match="partition-id 1"):
        run_on_flower(config, grid, tmp_path / "out", wait_seconds=5)
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "failed"


def test_flower_builds_the_text_model_from_the_nodes_vocabulary(tmp_path):
    """AG News on Flower: the ServerApp learns the vocabulary size from the nodes' query replies."""
    words = ["stocks", "rise", "team", "wins", "match", "chip", "launch", "election", "vote", "market"]
    rows = [f'"{1 + i % 4}","{words[i % 10]} {words[(i * 3) % 10]}","{words[(i * 7) % 10]} news"' for i in range(48)]
    (tmp_path / "agnews").mkdir()
    (tmp_path / "agnews" / "train.csv").write_text("\n".join(rows[:40]) + "\n", encoding="utf-8")
    (tmp_path / "agnews" / "test.csv").write_text("\n".join(rows[40:]) + "\n", encoding="utf-8")
    config = load_config(
        None,
        [
            "dataset=agnews",
            f"data_dir='{tmp_path / 'agnews'}'",
            "num_clients=2",
            "partition=iid",
            "rounds=1",
            'algorithms=["fedala"]',
            "engine=loop",
            "fedala.max_start_epochs=2",
        ],
    )
    grid = LocalGrid(client_app, [{"partition-id": i, "num-partitions": 2} for i in range(2)])
    run_on_flower(config, grid, tmp_path / "flower", wait_seconds=5)
    run_experiment(config, tmp_path / "sim", progress=False, echo=lambda s: None)
    flower, sim = [json.loads((tmp_path / f / "summary.json").read_text())["fedala"] for f in ("flower", "sim")]
    assert flower["best_accuracy"] == pytest.approx(sim["best_accuracy"], abs=1e-9)


class DiesAfterSending(LocalGrid):
    """A grid whose ServerApp process 'dies' right after the clients answered ``(algorithm, round)``."""

    def __init__(self, node_configs, die_at):
        super().__init__(client_app, node_configs)
        self.die_at = die_at

        self.awaited: set[str] = set()  # the messages of (algorithm, round) whose replies end the process

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        meta = messages[0].content["pflkit"] if messages else {}
        if "algorithm" in meta and (str(meta["algorithm"]), int(meta["round"])) == self.die_at:
            self.awaited = set(ids)
        return ids

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        if self.awaited:
            self.awaited -= {r.metadata.reply_to_message_id for r in replies}
            if not self.awaited:  # every client answered: the server dies before it aggregates
                raise KeyboardInterrupt("ServerApp killed")
        return replies


def test_a_restarted_server_app_continues_from_its_checkpoint_like_an_uninterrupted_run(tmp_path):
    config = load_config(None, OVERRIDES + ['algorithms=["fedavg","fedala"]'])
    nodes = [{"partition-id": i, "num-partitions": 3, "state-dir": str(tmp_path / f"node{i}")} for i in range(3)]
    out = tmp_path / "flower"
    # fedala's clients trained round 2 and saved it, but the server died before aggregating it
    with pytest.raises(KeyboardInterrupt):
        run_on_flower(config, DiesAfterSending(nodes, ("fedala", 2)), out, wait_seconds=5)
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    assert not (out / "summary.json").exists()
    # a new ServerApp process (and new ClientApp contexts: a new Flower run) with the same config
    run_on_flower(config, LocalGrid(client_app, nodes), out, wait_seconds=5)
    run_experiment(config, tmp_path / "sim", progress=False, echo=lambda s: None)

    def records(folder):
        return [
            {k: v for k, v in json.loads(line).items() if "seconds" not in k}
            for line in (folder / "metrics.jsonl").read_text().splitlines()
        ]

    resumed, sim = records(out), records(tmp_path / "sim")
    assert [(r["algorithm"], r["round"]) for r in resumed] == [(r["algorithm"], r["round"]) for r in sim]
    for f, s in zip(resumed, sim):
        for key in f:
            assert f[key] == (pytest.approx(s[key], abs=1e-9) if isinstance(f[key], float) else s[key]), key
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    with pytest.raises(FileExistsError, match="complete run"):
        run_on_flower(config, LocalGrid(client_app, nodes), out, wait_seconds=5)
    other = load_config(None, OVERRIDES + ['algorithms=["fedavg","fedala"]', "rounds=4"])
    (out / "summary.json").unlink()
    (out / "run.json").write_text((out / "run.json").read_text().replace('"complete"', '"failed"'))
    with pytest.raises(FileExistsError, match="another config.*rounds"):
        run_on_flower(other, LocalGrid(client_app, nodes), out, wait_seconds=5)


def test_the_global_model_methods_on_flower_match_the_simulator_under_the_official_protocol(tmp_path):
    """FedACD's baselines with global metrics and the adaptability metrics: the ServerApp scores the
    global model on the test split it reads itself, the nodes report their local models' scores."""
    config = load_config(
        None,
        [
            "dataset=synthetic",
            "num_clients=3",
            "alpha=0.5",
            "rounds=2",
            "engine=loop",
            "test_set=official",
            "metrics.adaptability=true",
            "creff.match_steps=5",
            "creff.retrain_epochs=1",
            'algorithms=["fedacd","fednova","fednh","creff","fedrod"]',
        ],
    )
    flower_records, sim_records = run_both(tmp_path, config)
    assert len(flower_records) == len(sim_records) == 15
    assert "global_accuracy" in flower_records[-1] and "local_risk" in flower_records[1]
    assert_same_records(flower_records, sim_records)


def test_sosicfl_on_flower_matches_the_simulator_and_refuses_evaluating_absent_clients(tmp_path):
    """The ServerApp prepares the simplex from the nodes' label counts; per-client payloads (the
    cluster centre and the round's alphas) and SosicFL+'s personal endpoints on the nodes give the
    simulator's numbers."""
    overrides = OVERRIDES + [
        "sosicfl.num_clusters=2",
        "sosicfl.pool_size=200",
        "sosicfl.n_init=2",
        'algorithms=["sosicfl", "sosicfl_plus"]',
    ]
    flower_records, sim_records = run_both(tmp_path, load_config(None, overrides))
    assert len(flower_records) == len(sim_records) == 8
    assert "update_variance" in flower_records[1]
    assert_same_records(flower_records, sim_records)
    grid = LocalGrid(client_app, [{"partition-id": i, "num-partitions": 3} for i in range(3)])
    with pytest.raises(ValueError, match="eval_all_clients = true runs in the simulator only"):
        run_on_flower(
            load_config(None, overrides + ["eval_all_clients=true"]), grid, tmp_path / "again", wait_seconds=5
        )
    with pytest.raises(ValueError, match="trace.clients runs in the simulator only"):
        run_on_flower(load_config(None, overrides + ["trace.clients=[0]"]), grid, tmp_path / "traced", wait_seconds=5)
    with pytest.raises(ValueError, match='state_store = "disk" runs in the simulator and on Flower.s Simulation'):
        run_on_flower(load_config(None, overrides + ["state_store=disk"]), grid, tmp_path / "disk", wait_seconds=5)
    assert not (tmp_path / "again").exists() and not (tmp_path / "traced").exists()  # nothing half-written
    assert not (tmp_path / "disk").exists()


class _OneClientFails(LocalGrid):
    """Node 1001 (client 1) answers its training messages with the error Flower's Simulation
    Engine sends for a ClientApp that raised."""

    def push_messages(self, messages):
        ids = []
        for message in messages:
            if message.metadata.dst_node_id == 1001 and message.metadata.message_type == MessageType.TRAIN:
                message.metadata.__dict__["_message_id"] = f"failed-{len(self._replies)}"
                reason = (
                    "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException ClientAppException "
                    "occurred. Message: CUDA out of memory on client 1'>"
                )
                error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
                self._replies[message.metadata.message_id] = Message(error, reply_to=message)
                ids.append(message.metadata.message_id)
            else:
                ids += list(super().push_messages([message]))
        return ids


def test_a_failing_client_is_named_in_one_line(tmp_path):
    config = load_config(None, OVERRIDES)
    grid = _OneClientFails(client_app, [{"partition-id": i} for i in range(3)])
    with pytest.raises(RuntimeError) as failed:
        run_on_flower(config, grid, tmp_path / "out", wait_seconds=5)
    message = str(failed.value)
    assert message == "fedavg seed 0 round 1: client 1 failed: CUDA out of memory on client 1"


def test_feature_shift_on_flower_matches_the_simulator_with_the_domains_on_the_global_test_set(tmp_path):
    """The nodes shift their clients' images, the ServerApp its global test set, as the simulator does."""
    config = load_config(
        None,
        [
            "dataset=synthetic",
            "num_clients=3",
            "alpha=0.5",
            "rounds=2",
            "engine=loop",
            "test_set=official",
            'feature_shift.transforms=["rotate","invert","noise"]',
            "feature_shift.rotations=3",
            'feature_shift.global_test="domains"',
            'algorithms=["fedavg"]',
        ],
    )
    flower_records, sim_records = run_both(tmp_path, config)
    assert len(flower_records) == len(sim_records) == 3
    assert "global_accuracy" in flower_records[-1]
    assert_same_records(flower_records, sim_records)

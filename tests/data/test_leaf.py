"""LEAF's JSON format (FEMNIST, Shakespeare, Sent140, pFedMe's numeric sets) and FedProx's
Synthetic(alpha, beta): natural clients, the checks on the files, the generator's statistics.

Every test writes its LEAF files under tmp_path in LEAF's layout; nothing touches the network.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.config import ConfigError, build_config
from pflkit.data import DataError, generate_synthetic, load_clients, load_dataset, load_leaf
from pflkit.data.fedprox_synthetic import DIMENSION, fedprox_synthetic, synthetic_sizes
from pflkit.data.leaf import LETTERS, split_line
from pflkit.federation import build_partitions
from pflkit.federation.reliability import reliability_of


def leaf_file(path: Path, users: dict[str, tuple[list[Any], list[Any]]]) -> Path:
    """One LEAF JSON file: users, num_samples and user_data, as LEAF's scripts write them."""
    doc = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def write_leaf(root: Path, kind: str, users: int = 3, seed: int = 0) -> Path:
    """A LEAF folder of ``kind`` with ``users`` users split over two training files and one test file."""
    rng = np.random.default_rng(seed)

    def samples(n: int) -> tuple[list[Any], list[Any]]:
        if kind == "femnist":
            return rng.random((n, 784)).round(3).tolist(), rng.integers(0, 62, n).tolist()
        if kind == "shakespeare":
            text = "".join(rng.choice(list(LETTERS), n + 80))
            return [text[i : i + 80] for i in range(n)], [text[i + 80] for i in range(n)]
        if kind == "sent140":
            words = ["good", "bad", "day", "!", "so", "sad", "happy", "it's"]
            rows = [["1", "Mon Apr 06", "NO_QUERY", "u", " ".join(rng.choice(words, 5))] for _ in range(n)]
            return rows, [str(v) for v in rng.choice([0, 4], n)]
        return rng.normal(size=(n, 60)).tolist(), rng.integers(0, 10, n).astype(float).tolist()  # FedProx's floats

    train = {f"f_{i:05d}": samples(4 + i) for i in range(users)}
    test = {u: samples(2) for u in train}
    names = list(train)
    leaf_file(root / "train" / "all_data_0_train_9.json", {u: train[u] for u in names[:1]})
    leaf_file(root / "train" / "all_data_1_train_9.json", {u: train[u] for u in names[1:]})
    leaf_file(root / "test" / "all_data_test_9.json", test)
    return root


def test_femnist_users_are_the_clients_in_file_order(tmp_path: Path) -> None:
    root = write_leaf(tmp_path / "femnist", "femnist")
    fed = load_leaf(root, "femnist")
    assert fed.num_clients == 3 and fed.num_classes == 62 and fed.input_shape == (1, 28, 28)
    assert [c.num_train for c in fed.clients] == [4, 5, 6] and [c.num_test for c in fed.clients] == [2, 2, 2]
    raw = json.loads((root / "train" / "all_data_1_train_9.json").read_text())["user_data"]["f_00002"]
    client = fed.clients[2]
    expected = (torch.tensor(raw["x"], dtype=torch.float32).view(-1, 1, 28, 28) - 0.5) / 0.5
    assert torch.allclose(client.train_x, expected) and client.train_y.tolist() == raw["y"]
    assert float(fed.x.min()) >= -1 and float(fed.x.max()) <= 1


def test_shakespeare_maps_characters_to_leaf_vocabulary(tmp_path: Path) -> None:
    assert len(LETTERS) == 80
    root = write_leaf(tmp_path / "shakespeare", "shakespeare")
    fed = load_leaf(root, "shakespeare")
    assert fed.vocab_size == 80 and fed.num_classes == 80 and fed.input_shape == (80,)
    raw = json.loads((root / "test" / "all_data_test_9.json").read_text())["user_data"]["f_00001"]
    client = fed.clients[1]
    assert "".join(LETTERS[i] for i in client.test_x[0].tolist()) == raw["x"][0]
    assert LETTERS[int(client.test_y[1])] == raw["y"][1]
    leaf_file(root / "test" / "all_data_test_9.json", {f"f_{i:05d}": (["é" * 80], ["a"]) for i in range(3)})
    with pytest.raises(DataError, match=r"all_data_test_9\.json: user 'f_00000': character 'é' is not in LEAF"):
        load_leaf(root, "shakespeare")


def test_sent140_tokenizes_with_leaf_rules_and_a_training_vocabulary(tmp_path: Path) -> None:
    assert split_line("It's so good!! day.") == ["It's", "so", "good", "!", "!", "day", "."]
    root = write_leaf(tmp_path / "sent140", "sent140")
    fed = load_leaf(root, "sent140")
    assert fed.num_classes == 2 and fed.input_shape == (25,) and fed.x.dtype == torch.int64
    raw = json.loads((root / "train" / "all_data_0_train_9.json").read_text())["user_data"]["f_00000"]
    assert fed.clients[0].train_y.tolist() == [1 if y == "4" else 0 for y in raw["y"]]
    first = fed.clients[0].train_x[0]
    assert (first[:5] >= 2).all() and (first[5:] == 0).all()  # five known words, then padding
    assert fed.vocab_size == 2 + len({w for x, _, _ in _train_rows(root) for w in split_line(x[4])})
    user = {"f_00000": ([["1", "d", "q", "u", "text"]], ["2"])}
    leaf_file(root / "train" / "all_data_0_train_9.json", user)
    with pytest.raises(DataError, match=r"Sent140 labels must be 0 \(negative\) or 4 \(positive\), found '2'"):
        load_leaf(root, "sent140")


def _train_rows(root: Path) -> list[tuple[list[Any], Any, Path]]:
    rows = []
    for path in sorted((root / "train").glob("*.json")):
        for entry in json.loads(path.read_text())["user_data"].values():
            rows += [(x, y, path) for x, y in zip(entry["x"], entry["y"])]
    return rows


def test_numeric_leaf_sets_keep_vectors_and_read_squares_as_images(tmp_path: Path) -> None:
    fed = load_leaf(write_leaf(tmp_path / "synthetic", "leaf"), "leaf")
    assert fed.input_shape == (60,) and fed.num_classes == 10 and fed.x.dtype == torch.float32
    mnist = {u: (np.ones((3, 784)).tolist(), [0, 3, 1]) for u in ("a", "b")}
    leaf_file(tmp_path / "mnist" / "data" / "train" / "mnist_train.json", mnist)  # pFedMe's data/train, data/test
    leaf_file(tmp_path / "mnist" / "data" / "test" / "mnist_test.json", mnist)
    fed = load_leaf(tmp_path / "mnist", "leaf")
    assert fed.input_shape == (1, 28, 28) and fed.num_classes == 4 and float(fed.x.max()) == 1.0


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda doc: doc["num_samples"].__setitem__(0, 99), r"user 'f_00001' has num_samples 99 but 5 x and 5 y"),
        (lambda doc: doc["num_samples"].pop(), r"2 users but 1 num_samples entries"),
        (lambda doc: doc["user_data"].pop("f_00002"), r"user 'f_00002' has no user_data entry"),
        (lambda doc: doc.pop("users"), r"expected a JSON object with users, num_samples and user_data"),
    ],
)
def test_a_leaf_file_that_contradicts_itself_is_refused_in_one_line(tmp_path: Path, corrupt: Any, message: str) -> None:
    root = write_leaf(tmp_path / "d", "leaf")
    path = root / "train" / "all_data_1_train_9.json"
    doc = json.loads(path.read_text())
    corrupt(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match=message) as info:
        load_leaf(root, "leaf")
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_truncated_missing_and_lonely_leaf_data_is_refused(tmp_path: Path) -> None:
    root = write_leaf(tmp_path / "d", "femnist")
    path = root / "train" / "all_data_0_train_9.json"
    path.write_text(path.read_text()[:500])
    with pytest.raises(DataError, match=r"all_data_0_train_9\.json is not readable LEAF JSON \(truncated") as info:
        load_leaf(root, "femnist")
    assert "\n" not in str(info.value)
    root = write_leaf(tmp_path / "e", "femnist")
    leaf_file(root / "test" / "all_data_test_9.json", {"f_00000": ([[0.5] * 784], [1])})
    with pytest.raises(DataError, match=r"has no samples of user 'f_00001'.*--t sample"):
        load_leaf(root, "femnist")
    with pytest.raises(DataError, match="lacks train/ and test/"):
        load_leaf(tmp_path, "femnist")
    with pytest.raises(DataError, match="holds per-client splits"):
        load_dataset("femnist", root)


def test_leaf_experiment_adopts_the_users_and_bypasses_the_partition(tmp_path: Path) -> None:
    root = write_leaf(tmp_path / "d", "femnist", users=4)
    config = build_config(
        {"dataset": "femnist", "data_dir": str(root), "num_clients": 20, "partition": "dirichlet", "seeds": [0, 1]}
    )
    adopted, partitions = build_partitions(config, torch.device("cpu"))
    assert adopted.partition.num_clients == 4 and partitions[0] is partitions[1]
    assert [c.num_train for c in partitions[0].clients] == [4, 5, 6, 7]
    assert adopted.resolved_model == "fedavg_cnn"
    assert build_config({"dataset": "leaf", "data_dir": "/x"}).model_for((60,)) == "mclr"
    assert build_config({"dataset": "shakespeare", "data_dir": "/x"}).resolved_model == "char_lstm"
    with pytest.raises(ConfigError, match="holds only per-client splits"):
        build_config({"dataset": "shakespeare", "data_dir": "/x", "test_set": "official"})
    with pytest.raises(ConfigError, match="dataset 'sent140' needs data_dir"):
        build_config({"dataset": "sent140"})


def test_a_dropout_schedule_is_checked_against_the_leaf_folders_own_clients(tmp_path: Path) -> None:
    """num_clients does not bound the schedule of a folder that brings its clients; once the folder
    is read, a client it lacks is refused by name."""
    root = write_leaf(tmp_path / "d", "femnist", users=4)
    base = {"dataset": "femnist", "data_dir": str(root), "num_clients": 2, "rounds": 1}
    config = build_config({**base, "run": {"dropout_schedule": [[1, 3]]}})  # client 3 of the 4 users
    adopted, _ = build_partitions(config, torch.device("cpu"))
    assert reliability_of(adopted.run, adopted.partition.num_clients) is not None
    config = build_config({**base, "run": {"dropout_schedule": [[1, 4]]}})
    adopted, _ = build_partitions(config, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"names client 4 in round 1, but the data has 4 clients \(0\.\.3\)"):
        reliability_of(adopted.run, adopted.partition.num_clients)


def test_settings_that_name_clients_are_checked_against_the_leaf_folders_own_clients(tmp_path: Path) -> None:
    """unseen_clients, trace.clients and feature-shift groups may exceed num_clients (which the folder
    replaces) and are bounded by the users the folder holds once it is read."""
    root = write_leaf(tmp_path / "d", "femnist", users=6)
    base = {"dataset": "femnist", "data_dir": str(root), "num_clients": 2, "rounds": 1}
    fits = build_config(
        {**base, "run": {"unseen_clients": 4}, "trace": {"clients": [5]}, "feature_shift": {"rotations": 6}}
    )
    adopted, _ = build_partitions(fits, torch.device("cpu"))
    assert adopted.partition.num_clients == 6 and adopted.unseen_client_ids() == [2, 3, 4, 5]
    assert build_config({**base, "run": {"unseen_clients": [5]}}).run.unseen_clients == [5]
    for settings, message in (
        ({"run": {"unseen_clients": 6}}, r"run.unseen_clients: 6 unseen clients of 6 leave none to train"),
        ({"run": {"unseen_clients": [6]}}, r"run.unseen_clients: unseen client ids \[6\] are not clients"),
        ({"trace": {"clients": [6]}}, r"trace.clients \[6\] are not clients of this run \(ids 0..5, .* holds 6"),
    ):
        config = build_config({**base, **settings})
        with pytest.raises(ConfigError, match=message):
            build_partitions(config, torch.device("cpu"))
    # On Flower num_clients is the count of SuperNodes, one a user: checked before anything starts.
    from pflkit.flower.server import check_flower_config

    with pytest.raises(ConfigError, match=r"6 unseen clients of 6 leave none .*num_clients = 6, one SuperNode each"):
        check_flower_config(build_config({**base, "num_clients": 6, "run": {"unseen_clients": 6}}))


# ---------------------------------------------------------------- Synthetic(alpha, beta)


def test_synthetic_sizes_are_lognormal_plus_50() -> None:
    sizes = synthetic_sizes(20_000, np.random.default_rng(0))
    assert sizes.min() >= 50
    for k in (10, 50, 200, 1000):  # P(n - 50 <= k) = P(LogNormal(4, 2) < k + 1)
        expected = 0.5 * (1 + math.erf((math.log(k + 1) - 4) / (2 * math.sqrt(2))))
        assert abs(np.mean(sizes - 50 <= k) - expected) < 0.015


def test_synthetic_is_seeded_sixty_dimensional_and_ten_class() -> None:
    a = generate_synthetic(6, 1.0, 1.0, seed=3)
    b = generate_synthetic(6, 1.0, 1.0, seed=3)
    c = generate_synthetic(6, 1.0, 1.0, seed=4)
    assert all(np.array_equal(xa, xb) and np.array_equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert not np.array_equal(a[0][0][:5], c[0][0][:5])
    assert [len(y) for _, y in a] == synthetic_sizes(6, np.random.default_rng(3)).tolist()
    for x, y in a:
        assert x.shape == (len(y), DIMENSION) and x.dtype == np.float32 and y.min() >= 0 and y.max() <= 9
    fed = fedprox_synthetic(6, 1.0, 1.0, seed=3)
    assert fed.input_shape == (60,) and fed.num_classes == 10
    assert [c.num_train for c in fed.clients] == [int(0.9 * len(y)) for _, y in a]


def test_synthetic_beta_spreads_the_client_inputs_and_sigma_is_diagonal_power_law() -> None:
    def input_spread(beta: float) -> float:
        means = [x.mean(0)[0] for x, _ in generate_synthetic(40, 0.0, beta, seed=1)]
        return float(np.std(means))

    assert input_spread(0.0) < 1.5 < input_spread(5.0)  # v_k ~ N(B_k, 1), B_k ~ N(0, beta)
    iid = generate_synthetic(30, 0.0, 0.0, iid=True, seed=2)
    x = np.concatenate([x for x, _ in iid]).astype(np.float64)
    assert abs(x.mean()) < 0.05  # Synthetic-IID: v_k = 0
    variances = x.var(0)
    expected = np.arange(1, 61, dtype=np.float64) ** -1.2  # Sigma = diag(j^-1.2)
    assert np.allclose(variances, expected, rtol=0.15)
    assert len(np.unique(np.concatenate([y for _, y in iid]))) >= 3


@pytest.mark.integration
def test_cli_runs_two_rounds_on_synthetic_and_a_leaf_folder(tmp_path: Path) -> None:
    common = ["rounds=2", 'algorithms=["fedavg"]', "engine=loop", "batch_size=4", "--quiet"]
    result = CliRunner().invoke(
        main,
        [
            "run",
            "dataset=fedprox_synthetic",
            "num_clients=3",
            "data.synthetic_alpha=0.5",
            "data.synthetic_beta=0.5",
            *common,
            "--out",
            str(tmp_path / "syn"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "synthetic_alpha = 0.5" in (tmp_path / "syn" / "config.toml").read_text()
    rounds = [json.loads(line) for line in (tmp_path / "syn" / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("round", 0) for r in rounds) == 2
    for kind, model in (("shakespeare", "char_lstm"), ("leaf", "dnn")):
        root = write_leaf(tmp_path / kind, kind)
        out = tmp_path / f"{kind}-out"
        args = ["run", f"dataset={kind}", f"data_dir={root}", f"model={model}", *common, "--out", str(out)]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert "num_clients = 3" in (out / "config.toml").read_text()


def test_load_clients_names_what_it_reads() -> None:
    with pytest.raises(ValueError, match="has no natural clients"):
        load_clients("mnist", None)
    with pytest.raises(DataError, match="needs data_dir"):
        load_clients("femnist", None)
    assert load_clients("fedprox_synthetic", None, num_clients=2, seed=0).num_clients == 2


def test_data_keys_of_another_dataset_are_named_unused() -> None:
    from pflkit.config import unused_keys

    table = {"data": {"synthetic_alpha": 0.5, "emnist_split": "balanced"}}
    assert unused_keys(table, build_config({"dataset": "digits", **table})) == [
        "data.synthetic_alpha = 0.5 is not used: only dataset = fedprox_synthetic reads it"
    ]
    assert unused_keys(table, build_config({"dataset": "fedprox_synthetic", **table})) == []


def test_a_sweep_over_synthetic_alpha_checks_each_cells_clients() -> None:
    from pflkit.run.sweep import check_cells, plan_sweep

    _, axes, cells = plan_sweep(
        None, ["dataset=fedprox_synthetic", "num_clients=3", "data.synthetic_alpha=[0.0,0.5]", "model=dnn"]
    )
    assert [a.key for a in axes] == ["data.synthetic_alpha"] and len(cells) == 2
    check_cells(cells)  # builds each cell's clients and checks its model fits them


@pytest.mark.parametrize("label", [4.5, "4.9", 0.7, "0.3", True, "x"])
def test_a_sent140_label_other_than_0_or_4_is_refused(label):
    from pflkit.data.leaf import _sentiment

    with pytest.raises(DataError, match="Sent140 labels must be 0"):
        _sentiment([0, label], "file.json")
    assert _sentiment([0, 4, "4", 4.0, "0.0"], "f").tolist() == [0, 1, 1, 1, 0]

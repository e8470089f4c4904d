"""benchmarks/pfllib_compare.py and pfllib_rounds.py: the exported partition, the round timing of a
PFLlib-shaped checkout, the ratios' arithmetic, and the committed result file."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pflkit.data.federated import ClientData, FederatedData
from pflkit.data.pfllib import load_pfllib
from tests.support.paths import REPO, load_script

COMMITTED = REPO / "docs" / "pfllib-compare.json"


def _script():  # type: ignore[no-untyped-def]
    return load_script("benchmarks/pfllib_compare.py")


def test_the_exported_partition_reads_back_client_by_client(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    clients = []
    for i, (n_train, n_test) in enumerate([(7, 3), (5, 2), (9, 4)]):
        x = torch.randn(n_train + n_test, 1, 4, 4, generator=g)
        y = torch.randint(0, 3, (n_train + n_test,), generator=g)
        clients.append(ClientData(i, x[:n_train], y[:n_train], x[n_train:], y[n_train:]))
    data = FederatedData.from_clients(clients, 3)
    _script().export_pfllib(data, tmp_path / "MNIST")
    back = load_pfllib(tmp_path / "MNIST")
    assert back.num_clients == 3
    for ours, theirs in zip(data.clients, back.clients, strict=True):
        for name in ("train_x", "train_y", "test_x", "test_y"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name


FAKE_SERVER = """
import time

class Server:
    def __init__(self, rounds, selects, budget, after, preempted):
        self.rounds, self.selects, self.after, self.preempted = rounds, selects, after, preempted
        self.Budget = [] if budget else None

    def select_clients(self):
        return []

    def train_metrics(self):
        time.sleep(0.4 if self.preempted and self.round == 1 else 0.06)

    def save_results(self):
        pass

    def train(self):
        for self.round in range(self.rounds + 1):
            # PFLlib times a round with time.time(); perf_counter here, since a clock-sync step of the
            # wall clock (seen on a loaded VM) would move these 0.1-s rounds past the checks' margins
            start = time.perf_counter()
            if self.preempted and self.round == 0:
                time.sleep(0.2)  # descheduled between the round's clock read and its first call
            for _ in range(self.selects):
                self.select_clients()
            self.train_metrics()
            time.sleep(0.03)  # the clients' training
            if self.Budget is not None:
                self.Budget.append(time.perf_counter() - start)
        time.sleep(self.after)  # FedBABU: every client fine-tunes after the last round
        self.save_results()
"""

FAKE_MAIN = """
import argparse
from flcore.servers.serverbase import Server
parser = argparse.ArgumentParser()
parser.add_argument("-gr", type=int)
parser.add_argument("-algo")
args = parser.parse_args()
selects = 2 if args.algo == "Local" else 1
after = 2.0 if args.algo == "FedBABU" else 0.0
Server(args.gr, selects, args.algo != "FedPHP", after, args.algo == "Preempted").train()
"""


def _fake_pfllib(root: Path) -> Path:
    """A checkout shaped as PFLlib's (system/main.py, flcore.servers.serverbase.Server, the pFedMe
    and Ditto servers) whose rounds sleep known times."""
    servers = root / "system" / "flcore" / "servers"
    servers.mkdir(parents=True)
    (root / "system" / "flcore" / "__init__.py").write_text("")
    (servers / "__init__.py").write_text("")
    (servers / "serverbase.py").write_text(textwrap.dedent(FAKE_SERVER))
    for module, cls in (("serverpFedMe", "pFedMe"), ("serverditto", "Ditto")):
        (servers / f"{module}.py").write_text(
            f"from flcore.servers.serverbase import Server\nclass {cls}(Server): pass\n"
        )
    (root / "system" / "main.py").write_text(FAKE_MAIN)
    return root


@pytest.mark.parametrize("algo", ["FedAvg", "Local", "FedBABU", "FedPHP", "Preempted"])
def test_pfllib_rounds_times_each_round_and_its_training_loss_pass(tmp_path, algo) -> None:
    """Rounds end where PFLlib's ``Budget`` says (FedBABU's fine-tuning after the last round is no
    round's), or at ``save_results`` for a server without one (FedPHP's). A round whose first call
    comes late ("Preempted") still counts its own training-loss pass alone, not the next round's."""
    pfllib = _fake_pfllib(tmp_path / "PFLlib")
    out = tmp_path / "times.json"
    command = [sys.executable, str(REPO / "benchmarks" / "pfllib_rounds.py"), "--pfllib", str(pfllib)]
    command += ["--workdir", str(tmp_path / "work"), "--threads", "1", "--out", str(out), "--", "-gr", "2"]
    subprocess.run([*command, "-algo", algo], check=True, cwd=tmp_path)
    rounds = json.loads(out.read_text())["rounds"]
    assert len(rounds) == 3  # -gr 2: rounds 0, 1 and 2, as PFLlib counts them
    for r in rounds:
        assert r["train_loss_pass"] >= 0.06
        assert r["wall"] >= r["train_loss_pass"] + 0.03
    assert rounds[-1]["wall"] < 1.5  # FedBABU's 2 s of fine-tuning are left out


def test_the_ratios_are_steady_medians_with_and_without_pfllibs_training_loss_pass() -> None:
    script = _script()
    pfllib = [{"wall": 60.0, "train_loss_pass": 10.0}, {"wall": 50.0, "train_loss_pass": 9.0}]
    pfllib += [{"wall": 46.0, "train_loss_pass": 12.0}]
    pflkit = [{"wall": 30.0}, {"wall": 21.0}, {"wall": 19.0}]
    e = script.entry("fedavg", pfllib, pflkit, first=2)
    assert e["pflkit_steady"] == 20.0
    assert e["as_run"] == pytest.approx(48.0 / 20.0)
    assert e["equal_work"] == pytest.approx(statistics.median([50.0 - 9.0, 46.0 - 12.0]) / 20.0)
    late = script.entry("fedala", pfllib, pflkit, first=3)
    assert late["as_run"] == pytest.approx(46.0 / 19.0)
    assert late["equal_work"] == pytest.approx(34.0 / 19.0)


def test_bad_arguments_are_named() -> None:
    script = _script()
    with pytest.raises(SystemExit):
        script.main(["--pfllib", str(REPO), "--data-dir", "x"])  # REPO holds no system/main.py
    with pytest.raises(SystemExit):
        script.main(["--data-dir", "x"])


@pytest.mark.parametrize(
    "path",
    [
        COMMITTED,
        REPO / "docs" / "pfllib-compare-epyc.json",
        REPO / "docs" / "pfllib-compare-short.json",
        REPO / "docs" / "pfllib-compare-chunked.json",
        REPO / "docs" / "pfllib-compare-representation.json",
    ],
    ids=lambda p: p.name,
)
def test_the_committed_comparison_is_what_its_round_times_give(path) -> None:
    committed = json.loads(path.read_text())
    again = _script().rescore(path)
    for name, e in committed["methods"].items():
        if "failed" in e:
            continue
        for key in ("as_run", "equal_work", "pfllib_steady", "pflkit_steady"):
            assert again["methods"][name][key] == pytest.approx(e[key], rel=1e-12), (name, key)

"""A real Flower deployment on loopback: SuperLink + 2 SuperNodes, TLS, SuperNode authentication; and
a node that stops answering for good, dropped under `tolerate_failures`.

Three rounds of FedALA on digits through `flwr run`: the ServerApp is killed (SIGKILL) after its
round-1 checkpoint and started again (a second `flwr run` with the same config), a SuperNode is
killed after round 2 and restarted; both resume from what they saved, and the finished run equals
the simulator's. Every process is stopped in teardown.

The test waits on events, each with its own timeout: a port accepting connections, a line in a
process's output (read by a thread into a queue), a file reaching a state. A wait that times out
fails with the name of the event and the tail of the output that should have shown it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

pytest.importorskip("flwr")
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pflkit.config import load_config
from pflkit.run.experiment import run_experiment
from tests.support.paths import REPO
from tests.support.runs import free_port, records

pytestmark = [pytest.mark.integration, pytest.mark.flower, pytest.mark.deployment, pytest.mark.slow]
BIN = Path(sys.executable).parent
# Per-event timeouts (seconds): generous, so that a loaded CI machine passes; none of them is a
# budget for the whole run.
STARTUP = 120  # a Flower process imports, starts and (SuperNodes) is activated by the SuperLink
ROUND = 300  # a checkpoint or a client's state advances past one more round
REACTIVATION = 300  # the SuperLink takes back a killed SuperNode (after it misses two ~30 s heartbeats)
RESTART_PAUSE = 2  # like a supervisor's RestartSec: between a refused SuperNode and its next start
ANSI = re.compile(r"\x1b\[[0-9;]*m")
T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], timeout: float, event: str, context: Callable[[], str] = lambda: "", poll: float = 0.2
) -> T:
    """Return ``condition()``'s first truthy value; fail naming ``event`` if none comes in ``timeout``
    seconds. ``condition`` may itself call ``pytest.fail`` (e.g. when the process it waits on died)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"{event}: did not happen within {timeout:.0f} s\n{context()}", pytrace=False)
        time.sleep(poll)
    return value


class Output:
    """A process's stdout and stderr, read line by line by a thread into a queue (and into a log file)."""

    EOF = None

    def __init__(self, name: str, proc: subprocess.Popen, log: Path) -> None:
        self.name, self.proc, self.lines = name, proc, []
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._read, args=(log,), name=f"read {name}", daemon=True)
        self.thread.start()

    def _read(self, log: Path) -> None:
        with open(log, "a", encoding="utf-8") as f:
            for raw in self.proc.stdout:
                line = ANSI.sub("", raw.decode(errors="replace")).rstrip()
                f.write(line + "\n")
                f.flush()
                self.lines.append(line)
                self.queue.put(line)
        self.queue.put(self.EOF)

    def tail(self, n: int = 40) -> str:
        return f"--- last {n} lines of {self.name}'s output ---\n" + "\n".join(self.lines[-n:])

    def wait_for(
        self, pattern: str, timeout: float, event: str, exit_ok: bool = False, context: Callable[[], str] = lambda: ""
    ) -> re.Match | None:
        """The first line not yet consumed that matches ``pattern``; ``None`` if the process's output
        ends first and ``exit_ok``. Fails naming ``event`` with the tail of this output otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.queue.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                pytest.fail(
                    f"{event}: no line matching {pattern!r} from {self.name} within {timeout:.0f} s\n"
                    f"{self.tail()}\n{context()}",
                    pytrace=False,
                )
            if line is self.EOF:
                if exit_ok:
                    return None
                pytest.fail(
                    f"{event}: {self.name} exited (code {self.proc.wait()}) first\n{self.tail()}\n{context()}",
                    pytrace=False,
                )
            if match := re.search(pattern, line):
                return match


def wait_for_port(port: int, output: Output, timeout: float) -> None:
    def listening() -> bool:
        if output.proc.poll() is not None:
            pytest.fail(
                f"{output.name} exited (code {output.proc.returncode}) before listening on port {port}\n"
                f"{output.tail()}",
                pytrace=False,
            )
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, timeout, f"{output.name} accepts connections on port {port}", output.tail)


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost signed by it."""

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("pflkit test CA"))
        .issuer_name(name("pflkit test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.crt", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def make_node_keys(folder: Path, i: int) -> tuple[Path, Path]:
    """The SuperNode's EC key pair in OpenSSH format, as Flower's node authentication expects."""
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / f"node{i}_key", folder / f"node{i}_key.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    return private, public


class Processes:
    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env, self.outputs = folder, env, {}

    def start(self, name: str, args: list[str]) -> Output:
        proc = subprocess.Popen(
            args, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.outputs[name] = output = Output(name, proc, self.folder / f"{name}.log")
        return output

    def __getitem__(self, name: str) -> Output:
        return self.outputs[name]

    def kill(self, name: str) -> None:
        """SIGKILL the process and its helpers (its process group), reap it, drain its output."""
        output = self.outputs.pop(name)
        try:
            os.killpg(output.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output.proc.wait(timeout=30)
        output.thread.join(timeout=30)
        if not output.thread.is_alive():  # a helper outside the group may still hold the pipe
            output.proc.stdout.close()

    def stop_all(self) -> None:
        for name in list(self.outputs):
            self.kill(name)

    def tails(self, n: int = 25) -> str:
        return "\n".join(output.tail(n) for output in self.outputs.values())


def flwr(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "flwr"), *args], env=env, capture_output=True, text=True, timeout=120)


def saved_rounds(path: Path) -> set[int]:
    """The rounds whose client state the file holds (the latest and the one before it)."""
    try:
        return {int(v["round"]) for v in torch.load(path, weights_only=True)["versions"]}
    except Exception:  # noqa: BLE001 - absent
        return set()


def rounds_done(checkpoint: Path) -> int:
    try:
        return int(torch.load(checkpoint, weights_only=True)["rounds_done"])
    except Exception:  # noqa: BLE001 - absent or being replaced
        return 0


def flower_env(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A fresh FLWR_HOME and the environment of every Flower process. Flower's processes start their
    helpers (flower-superexec, flwr-clientapp) by name: this interpreter's scripts go first on PATH,
    whether or not the virtualenv is activated."""
    home = tmp_path / "flwr-home"
    home.mkdir()
    return home, {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def start_superlink(
    procs: Processes, tmp_path: Path, home: Path, port: int, security: list[str], connection: str
) -> Output:
    """A SuperLink on 127.0.0.1:``port`` with the ``security`` options, once it accepts connections;
    ``flwr``'s connection "test" to it, with the ``connection`` line (TLS root or insecure)."""
    link = procs.start(
        "superlink",
        [
            str(BIN / "flower-superlink"),
            *security,
            "--disable-runtime-dependency-installation",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--database",
            str(tmp_path / "link.db"),
        ],
    )
    wait_for_port(port, link, STARTUP)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\n{connection}\n'
    )
    return link


def start_flwr_run(overrides: str, out: Path, env: dict[str, str], timeout: float) -> int:
    """``flwr run`` of the pflkit app on connection "test"; the run's id."""
    started = flwr(
        [
            "run",
            str(REPO / "flower-app"),
            "test",
            "--format",
            "json",
            "-c",
            f'overrides="{overrides}" out="{out}" wait-seconds=120.0 timeout={timeout}',
        ],
        env,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    return int(json.loads(started.stdout)["run-id"])


def test_tls_auth_deployment_survives_a_killed_server_app_and_a_killed_node(tmp_path):
    """Three rounds of FedALA: the ServerApp is killed (SIGKILL) once its round-1 checkpoint is
    written and started again with the same run config (a new `flwr run`); a SuperNode is killed
    and restarted after round 2. The finished run equals the simulator's uninterrupted run."""
    home, env = flower_env(tmp_path)
    ca, cert, key = make_certificates(tmp_path)
    keys = [make_node_keys(tmp_path, i) for i in range(2)]
    port = free_port()
    procs = Processes(tmp_path, env)
    run_ids: list[int] = []

    def server_app_log() -> str:
        if not run_ids:
            return ""
        try:
            shown = flwr(["log", str(run_ids[-1]), "--show"], env)
            text = shown.stdout + shown.stderr
        except subprocess.TimeoutExpired:
            text = "(flwr log timed out)"
        return f"--- ServerApp log of run {run_ids[-1]} (tail) ---\n{text[-4000:]}"

    def context() -> str:
        return f"{server_app_log()}\n{procs.tails()}"

    try:
        tls = ["--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
        link = start_superlink(
            procs, tmp_path, home, port, [*tls, "--enable-supernode-auth"], f'root-certificates = "{ca}"'
        )
        for _, public in keys:
            done = flwr(["supernode", "register", str(public), "test"], env)
            assert done.returncode == 0, done.stdout + done.stderr
        state_dirs = [tmp_path / f"node{i}" for i in range(2)]

        def start_node(i: int) -> Output:
            return procs.start(
                f"node{i}",
                [
                    str(BIN / "flower-supernode"),
                    "--root-certificates",
                    str(ca),
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--port",
                    str(free_port()),
                    "--auth-supernode-private-key",
                    str(keys[i][0]),
                    "--node-config",
                    f'partition-id={i} num-partitions=2 state-dir="{state_dirs[i]}"',
                ],
            )

        def activated(node: Output, refusal_ok: bool = False) -> bool:
            """Wait for the SuperLink to activate the node; False if it refuses the node or the node
            exits first (``refusal_ok``). A refused SuperNode exits, but the SuperExec it started may
            keep its output open, retrying, so the refusal is read from the output, not from its end."""
            match = node.wait_for(
                r"SuperNode ID: \d+|Failed to activate SuperNode",
                STARTUP,
                f"the SuperLink activates {node.name}",
                exit_ok=refusal_ok,
                context=link.tail,
            )
            if match is not None and match[0].startswith("Failed") and not refusal_ok:
                pytest.fail(f"the SuperLink refused {node.name}\n{node.tail()}\n{link.tail()}", pytrace=False)
            return match is not None and not match[0].startswith("Failed")

        for node in [start_node(i) for i in range(2)]:
            activated(node)
        out = tmp_path / "results"
        # the fewest samples and epochs that still run ALA's start phase and a state per client: the
        # test's time goes to the processes and the restarts, not to training
        overrides = "dataset=synthetic num_clients=2 rounds=3 algorithms=['fedala'] fedala.max_start_epochs=3 alpha=0.5"

        def start_run() -> None:
            run_ids.append(start_flwr_run(overrides, out, env, 120.0))

        def run_ended(run_id: int) -> str:
            return rf"(Finished|Failed to finish) task \d+ of run {run_id}\b"

        checkpoint = out / "checkpoints" / "fedala-seed0.pt"

        def wait_for_checkpoint(rounds: int, event: str) -> None:
            run_id = run_ids[-1]

            def written() -> bool:
                if any(re.search(run_ended(run_id), line) for line in list(link.lines)):
                    pytest.fail(f"{event}: the ServerApp of run {run_id} ended first\n{context()}", pytrace=False)
                return rounds_done(checkpoint) >= rounds

            wait_until(written, ROUND, event, context)

        state_file = [d / "pflkit.fedala.seed0.pt" for d in state_dirs]
        seen: list[set[int]] = [set(), set()]

        def note_saved_rounds() -> None:
            for i in range(2):
                seen[i] |= saved_rounds(state_file[i])

        # 1. the ServerApp, killed right after its round-1 checkpoint, then a second `flwr run`
        start_run()
        wait_for_checkpoint(1, "the ServerApp writes its round-1 checkpoint")
        os.kill(json.loads((out / "run.json").read_text())["pid"], signal.SIGKILL)
        note_saved_rounds()  # both clients saved round 1 before replying (round 2 at most since)
        start_run()
        # 2. a SuperNode, killed between rounds: the resumed server has aggregated round 2
        wait_for_checkpoint(2, "the restarted ServerApp resumes and writes its round-2 checkpoint")
        note_saved_rounds()
        procs.kill("node1")

        def node1_back() -> bool:
            # The SuperLink refuses to re-activate a node until its old session misses two
            # heartbeats (~60 s): the SuperNode then exits; like a supervisor with
            # Restart=on-failure, start it again.
            if activated(start_node(1), refusal_ok=True):
                return True
            refused = "Failed to activate SuperNode" in "\n".join(procs["node1"].lines)
            tail = procs["node1"].tail()
            procs.kill("node1")
            if not refused:
                pytest.fail(
                    f"the restarted node1 exited for another reason than a refused activation\n{tail}", pytrace=False
                )
            time.sleep(RESTART_PAUSE)
            return False

        wait_until(node1_back, REACTIVATION, "the SuperLink takes back the restarted node1", context, poll=0)
        resumed = procs["node1"].wait_for(
            r"client 1 resumes pflkit\.fedala\.seed0 from its state saved after round (\d+)",
            ROUND,
            "the restarted node1's client resumes from its state file",
            context=context,
        )
        assert resumed[1] == "2", f"node1 resumed from round {resumed[1]}, not from its state after round 2"
        # 3. the run finishes
        link.wait_for(run_ended(run_ids[-1]), ROUND, f"the ServerApp of run {run_ids[-1]} finishes", context=context)
        listing = flwr(["list", "--run-id", str(run_ids[-1]), "--format", "json"], env)
        assert listing.returncode == 0, listing.stdout + listing.stderr
        status = json.loads(listing.stdout)["runs"][0]["status"]
        if status != "finished:completed":
            pytest.fail(f"run status {status!r}\n{context()}", pytrace=False)
        note_saved_rounds()
        assert seen[0] >= {1, 2, 3} and seen[1] >= {1, 2, 3}, seen  # every client's state advanced every round
        assert json.loads((out / "run.json").read_text())["status"] == "complete"
        state = torch.load(state_file[1], weights_only=True)["versions"][0]["state"]
        assert state["ala"]["started"] is True
        # the interrupted deployment equals one uninterrupted run of the simulator's reference engine
        config = load_config(None, overrides.split() + ["engine=loop"])
        run_experiment(config, tmp_path / "sim", progress=False, echo=lambda s: None)
        deployed, sim = records(out), records(tmp_path / "sim")
        assert [r["round"] for r in deployed] == [0, 1, 2, 3]
        assert len(deployed) == len(sim)
        for d, s in zip(deployed, sim):
            for k in d:
                assert d[k] == (pytest.approx(s[k], abs=1e-9) if isinstance(d[k], float) else s[k]), k
    finally:
        procs.stop_all()


def test_a_node_that_stops_answering_is_dropped_when_failures_are_tolerated(tmp_path):
    """Three rounds of FedAvg on two SuperNodes (plain gRPC); node 1 is killed (SIGKILL) once the
    round-1 checkpoint is written and never comes back. With ``tolerate_failures`` the ServerApp
    waits ``timeout`` seconds for each round's replies, counts client 1 as dropped in rounds 2 and 3
    (``lost_replies``), aggregates node 0's uploads and finishes the run."""
    home, env = flower_env(tmp_path)
    port = free_port()
    procs = Processes(tmp_path, env)
    try:
        link = start_superlink(procs, tmp_path, home, port, ["--insecure"], "insecure = true")
        for i in range(2):
            node = procs.start(
                f"node{i}",
                [
                    str(BIN / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--port",
                    str(free_port()),
                    "--node-config",
                    f'partition-id={i} num-partitions=2 state-dir="{tmp_path / f"node{i}"}"',
                ],
            )
            node.wait_for(r"SuperNode ID: \d+", STARTUP, f"the SuperLink activates node{i}", context=link.tail)
        out = tmp_path / "results"
        overrides = (
            "dataset=synthetic num_clients=2 rounds=3 algorithms=['fedavg'] alpha=0.5 run.tolerate_failures=true"
        )
        run_id = start_flwr_run(overrides, out, env, 20.0)
        ended = rf"(Finished|Failed to finish) task \d+ of run {run_id}\b"

        def context() -> str:
            shown = flwr(["log", str(run_id), "--show"], env)
            return f"--- ServerApp log (tail) ---\n{(shown.stdout + shown.stderr)[-4000:]}\n{procs.tails()}"

        def round_1_written() -> bool:
            if any(re.search(ended, line) for line in list(link.lines)):
                pytest.fail(f"the ServerApp of run {run_id} ended before round 1\n{context()}", pytrace=False)
            return rounds_done(out / "checkpoints" / "fedavg-seed0.pt") >= 1

        wait_until(round_1_written, ROUND, "the ServerApp writes its round-1 checkpoint", context)
        procs.kill("node1")
        link.wait_for(ended, ROUND, f"the ServerApp of run {run_id} finishes", context=context)
        listing = flwr(["list", "--run-id", str(run_id), "--format", "json"], env)
        assert listing.returncode == 0, listing.stdout + listing.stderr
        assert json.loads(listing.stdout)["runs"][0]["status"] == "finished:completed", context()
        assert json.loads((out / "run.json").read_text())["status"] == "complete"
        trained = {r["train_round"]: r for r in records(out) if "train_round" in r}
        assert sorted(trained) == [1, 2, 3]
        assert trained[1].get("lost_replies") is None and trained[1].get("dropped_clients", 0) == 0
        for t in (2, 3):
            assert trained[t]["lost_replies"] == [1] and trained[t]["dropped_clients"] == 1, trained[t]
            assert not trained[t].get("aggregation_skipped")  # node 0's upload was aggregated
    finally:
        procs.stop_all()

"""A real Flower deployment on loopback: SuperLink + 2 SuperNodes, TLS, SuperNode authentication.

Three rounds of FedALA on digits through `flwr run`: the ServerApp is killed (SIGKILL) after its
round-1 checkpoint and started again (a second `flwr run` with the same config), a SuperNode is
killed after round 2 and restarted; both resume from what they saved, and the finished run equals
the simulator's. Every process is stopped in teardown.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from pflkit.config import load_config  # noqa: E402
from pflkit.run.experiment import run_experiment  # noqa: E402

pytestmark = pytest.mark.deployment
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEADLINE = 300  # seconds for the whole run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, seconds: float = 60) -> None:
    end = time.time() + seconds
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port}")


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost signed by it."""
    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder().subject_name(name("pflkit test CA")).issuer_name(name("pflkit test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.crt", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def make_node_keys(folder: Path, i: int) -> tuple[Path, Path]:
    """The SuperNode's EC key pair in OpenSSH format, as Flower's node authentication expects."""
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / f"node{i}_key", folder / f"node{i}_key.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH))
    return private, public


class Processes:
    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env, self.procs = folder, env, {}

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.folder / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.kill(name)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")


def flwr(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "flwr"), *args], env=env, capture_output=True, text=True, timeout=120)


def saved_round(path: Path) -> int | None:
    try:
        return int(torch.load(path, weights_only=True)["round"])
    except Exception:  # noqa: BLE001 - absent or being replaced
        return None


def rounds_done(checkpoint: Path) -> int:
    try:
        return int(torch.load(checkpoint, weights_only=True)["rounds_done"])
    except Exception:  # noqa: BLE001 - absent or being replaced
        return 0


def records(folder: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if "seconds" not in k}
            for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_tls_auth_deployment_survives_a_killed_server_app_and_a_killed_node(tmp_path):
    """Three rounds of FedALA: the ServerApp is killed (SIGKILL) once its round-1 checkpoint is
    written and started again with the same run config (a new `flwr run`); a SuperNode is killed
    and restarted after round 2. The finished run equals the simulator's uninterrupted run."""
    home = tmp_path / "flwr-home"
    home.mkdir()
    # Flower's processes start their helpers (flower-superexec, flwr-clientapp) by name: put this
    # interpreter's scripts first on PATH, whether or not the virtualenv is activated.
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    ca, cert, key = make_certificates(tmp_path)
    keys = [make_node_keys(tmp_path, i) for i in range(2)]
    port = free_port()
    procs = Processes(tmp_path, env)
    try:
        link = procs.start("superlink", [
            str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert),
            "--ssl-keyfile", str(key), "--enable-supernode-auth", "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1", "--port", str(port), "--database", str(tmp_path / "link.db")])
        wait_for_port(port, link)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\n'
            f'root-certificates = "{ca}"\n')
        for _, public in keys:
            done = flwr(["supernode", "register", str(public), "test"], env)
            assert done.returncode == 0, done.stdout + done.stderr
        state_dirs = [tmp_path / f"node{i}" for i in range(2)]

        def start_node(i: int) -> None:
            procs.start(f"node{i}", [
                str(BIN / "flower-supernode"), "--root-certificates", str(ca), "--superlink", f"127.0.0.1:{port}",
                "--port", str(free_port()), "--auth-supernode-private-key", str(keys[i][0]),
                "--node-config", f'partition-id={i} num-partitions=2 state-dir="{state_dirs[i]}"'])

        for i in range(2):
            start_node(i)
        out = tmp_path / "results"
        overrides = "num_clients=2 rounds=3 algorithms=['fedala'] fedala.max_start_epochs=20 alpha=0.5"

        def start_run() -> int:
            started = flwr(["run", str(REPO / "flower-app"), "test", "--format", "json", "-c",
                            f'overrides="{overrides}" out="{out}" wait-seconds=120.0 timeout=120.0'], env)
            assert started.returncode == 0, started.stdout + started.stderr
            return json.loads(started.stdout)["run-id"]

        run_ids = [start_run()]
        checkpoint = out / "checkpoints" / "fedala-seed0.pt"
        state_file = [d / "pflkit.fedala.seed0.pt" for d in state_dirs]
        seen: list[set[int]] = [set(), set()]
        server_killed = node_killed = False
        status = ""
        end = time.time() + DEADLINE
        while time.time() < end:
            for i in range(2):
                r = saved_round(state_file[i])
                if r is not None:
                    seen[i].add(r)
            if not server_killed and rounds_done(checkpoint) >= 1:
                pid = json.loads((out / "run.json").read_text())["pid"]
                os.kill(pid, signal.SIGKILL)  # the ServerApp process, right after its round-1 checkpoint
                server_killed = True
                run_ids.append(start_run())
            elif server_killed and not node_killed and rounds_done(checkpoint) >= 2:
                procs.kill("node1")  # between rounds: the resumed server has aggregated round 2
                start_node(1)
                node_killed = True
            elif node_killed and procs.procs["node1"].poll() is not None:
                # The SuperLink refuses to re-activate a node until its old session misses two
                # heartbeats (~60 s); like a supervisor with Restart=on-failure, try again.
                procs.procs.pop("node1")
                time.sleep(3)
                start_node(1)
            if server_killed:
                listing = flwr(["list", "--run-id", str(run_ids[-1]), "--format", "json"], env)
                if listing.returncode == 0:
                    status = json.loads(listing.stdout)["runs"][0]["status"]
                    if status.startswith("finished"):
                        break
            time.sleep(1)
        for i in range(2):  # pick up the last save
            r = saved_round(state_file[i])
            if r is not None:
                seen[i].add(r)
        logs = {name: procs.log(name) for name in ("superlink", "node0", "node1")}
        if status != "finished:completed":
            run_log = flwr(["log", str(run_ids[-1]), "--show"], env)
            pytest.fail(f"run status {status!r}\nServerApp log:\n{(run_log.stdout + run_log.stderr)[-4000:]}\n"
                        f"node1 log:\n{logs['node1'][-2500:]}\nsuperlink log:\n{logs['superlink'][-2500:]}")
        assert server_killed and node_killed
        assert seen[0] >= {1, 2, 3} and seen[1] >= {1, 2, 3}, seen  # every client's state advanced every round
        assert "resumes pflkit.fedala.seed0 from its state saved after round 2" in logs["node1"], logs["node1"][-3000:]
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

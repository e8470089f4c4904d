"""The results folder of one experiment.

config.toml       the resolved configuration (every default filled in)
run.json          status: running | failed (with the error) | complete; pflkit version, host and
                  process id of the run
metrics.jsonl     one JSON record per (algorithm, seed, round)
summary.json      written last, only when every run finished
partition-seed<k>.json  the partition of partition seed k: how it was drawn (method, rng, the
                  minimum enforced, any fallback) and each client's train/test class counts
plots/            accuracy.png, partition-seed<k>.png
checkpoints/      <algorithm>-seed<k>.pt, the latest state of each run (for --resume)
tensorboard/      <algorithm>-seed<k>/, one TensorBoard run per method and seed (tracker = "tensorboard")
flower.log        Flower's full log of a run on its Simulation Engine
.lock             held (``flock``) by the process that writes the folder: a second one is refused

A packed folder (``pflkit pack``) holds every file of its top level, config.toml included, byte
for byte, in records.tar.xz (``archive``); it is read exactly as the plain one and never written
(``pflkit unpack`` restores the plain files).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import socket
import stat
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; folders are not guarded there
    fcntl = None  # type: ignore[assignment]  # the optional-module idiom

import tomli_w

from .. import __version__
from .archive import ARCHIVE, read_archive
from .checkpoint import load_checkpoint
from .driver import RunState

if TYPE_CHECKING:
    from ..config import BaseConfig


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


LOCK_FILE = ".lock"
#: files that may stand in a folder before its run starts: the lock, and Flower's log of a simulation
BEFORE_THE_RUN = frozenset({LOCK_FILE, "flower.log"})


class FolderBusyError(RuntimeError):
    """Another process holds the results folder."""


@contextmanager
def folder_lock(root: Path, what: str = "results folder") -> Iterator[None]:
    """Hold ``root``'s lock for the block; while another process holds it, refuse with its pid and
    host. The kernel drops the lock when its holder dies, so a killed run never blocks a resume."""
    root.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    path = root / LOCK_FILE
    try:  # never through a link: the lock file is truncated and written below
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError:
        if path.is_symlink():
            raise FolderBusyError(
                f"{path} is a symbolic link (to {os.readlink(path)}): pflkit writes its lock file "
                "there and would overwrite what it points to; remove the link"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FolderBusyError(f"{path} is not a regular file: remove it (pflkit keeps its lock there)")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            raise FolderBusyError(
                f"{what} {root} is in use by {holder}: wait until it ends (or stop it), or choose another folder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            f"pflkit pid {os.getpid()} on host {socket.gethostname()} since "
            f"{dt.datetime.now().isoformat(timespec='seconds')}\n".encode(),
            0,
        )
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


#: ``[run]`` keys that say how a run executes, not what it computes (the engines give the same
#: numbers for any number of workers): a run, or a sweep cell, continues under other values (more
#: workers on a bigger machine), so comparisons of a saved config leave them out.
EXECUTION_KEYS = frozenset({"run.workers", "run.state_cache", "run.checkpoint_every", "run.tracker"})

#: where a folder's run executes, as run.json records it, and how each says so in messages
BACKENDS = {
    "simulator": "in the simulator (pflkit run)",
    "flower": "on a Flower deployment",
    "flower-simulation": "on Flower's Simulation Engine (pflkit run --on flower-simulation)",
}
RESUME_COMMANDS = {
    "simulator": "pflkit run --resume FOLDER",
    "flower": "start its ServerApp again with the same out folder",
    "flower-simulation": "its pflkit run --on flower-simulation command again, with --out FOLDER",
}


def _comparable(record: Mapping[str, Any]) -> str:
    """A record as JSON (what metrics.jsonl holds), for comparing a checkpoint's with the file's."""
    return json.dumps(record, sort_keys=True)


def differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two config tables, sorted."""
    keys = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, Mapping) and isinstance(y, Mapping):
            keys += differences(x, y, f"{prefix}{k}.")
        elif x != y:
            keys.append(prefix + k)
    return keys


def config_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def machine() -> str:
    """What ran a run, for reports: CPU, cores this process may use, PyTorch and CUDA device."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {cores} cores, {gpu}, torch {torch.__version__}"


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file pflkit wrote as an object (summary.json, sweep.json): the object, or an error
    naming the file."""
    return parse_json_object(path.read_bytes(), str(path))


def parse_json_object(content: bytes, where: str) -> dict[str, Any]:
    """The object of a JSON file's ``content``, or an error naming the file (``where``)."""
    try:
        data = json.loads(content.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{where} holds a JSON {type(data).__name__}, not the object pflkit writes: "
            "the folder is damaged or was not written by pflkit"
        )
    return data


#: what the records of a folder mean (the fields of metrics.jsonl, summary.json and partition
#: files, and what checkpoints hold): a run resumes only in the format it started in. A folder
#: written before run.json named its format is format 1.
RECORDS_FORMAT = 1
RUN_FILE = "run.json"
CONFIG_FILE = "config.toml"


class PackedFolderError(RuntimeError):
    """A write into a packed results folder."""


class ResultsFolder:
    """One results folder (the layout above): its paths, writing it while a run goes on, and
    reading it back (``status``: run.json, ``config_text``, ``config_table`` and ``load_config``:
    config.toml, ``records`` and ``histories``: metrics.jsonl, ``summary``: summary.json) for
    resumes, sweeps and reports. ``config_path`` is where a run writes its config: a packed
    folder's is in its archive, so readers go through these methods."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._members: tuple[tuple[int, int], dict[str, tuple[bytes, int]]] | None = None

    @property
    def archive_path(self) -> Path:
        return self.root / ARCHIVE

    @property
    def packed(self) -> bool:
        """Whether the folder's records are in its archive (``pflkit pack``)."""
        return self.archive_path.is_file()

    def archived(self) -> dict[str, tuple[bytes, int]]:
        """The archive's members (name -> (content, modification time)); none in a plain folder."""
        if not self.packed:
            return {}
        st = self.archive_path.stat()
        key = (st.st_mtime_ns, st.st_size)
        if self._members is None or self._members[0] != key:
            self._members = (key, read_archive(self.archive_path))
        return self._members[1]

    def has(self, name: str) -> bool:
        """Whether the folder holds file ``name`` (plain, or in its archive)."""
        return (self.root / name).is_file() or name in self.archived()

    def read_bytes(self, name: str) -> bytes:
        """File ``name`` of the folder, plain or from its archive."""
        if (self.root / name).is_file():
            return (self.root / name).read_bytes()
        members = self.archived()
        if name not in members:
            raise FileNotFoundError(f"{self.root} holds no {name}")
        return members[name][0]

    def where(self, name: str) -> str:
        """File ``name`` as messages name it: its path, or the archive that holds it."""
        plain = self.root / name
        return str(plain) if plain.is_file() or not self.packed else f"{self.archive_path} ({name})"

    def check_writable(self) -> None:
        """Refuse to write into a packed folder."""
        if self.packed:
            raise PackedFolderError(
                f"{self.root} is packed (its records are in {ARCHIVE}) and is not written; "
                f"to continue or change it, restore its files first: pflkit unpack {self.root}"
            )

    def locked(self) -> Any:
        """Context manager: this process alone writes the folder (see :func:`folder_lock`)."""
        return folder_lock(self.root)

    @property
    def config_path(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.root / "summary.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    def checkpoint_path(self, algorithm: str, seed: int) -> Path:
        return self.root / "checkpoints" / f"{algorithm}-seed{seed}.pt"

    def states_path(self, algorithm: str, seed: int) -> Path:
        """The folder of one run's client state files (``state_store = "disk"``)."""
        return self.root / "states" / f"{algorithm}-seed{seed}"

    def create(self, config: Mapping[str, Any], backend: str = "simulator") -> None:
        """Start a new folder for a run on ``backend`` (``BACKENDS``); refuse one that already holds files."""
        if self.root.exists() and any(p.name not in BEFORE_THE_RUN for p in self.root.iterdir()):
            raise FileExistsError(
                f"results folder {self.root} already exists and is not empty; "
                f"use --resume {self.root} to continue it, or choose another --out"
            )
        (self.root / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.plots.mkdir(exist_ok=True)
        text = tomli_w.dumps(dict(config))
        atomic_write_text(self.config_path, text)
        self.metrics_path.touch()
        self.set_status("running", config_sha256=config_digest(text), backend=backend)

    def start_or_resume(
        self,
        config: Mapping[str, Any],
        resolve: Callable[[dict[str, Any]], Mapping[str, Any]] = dict,
        backend: str = "simulator",
    ) -> bool:
        """Create the folder for ``config``; or, when it holds an unfinished run of the same
        config on the same ``backend``, return True: the caller continues that run. ``resolve`` maps
        the saved table to the form of ``config`` (an older pflkit wrote its keys flat)."""
        if not self.has(RUN_FILE):
            self.create(config, backend)
            return False
        if self.status()["status"] == "complete":
            raise FileExistsError(f"results folder {self.root} holds a complete run; choose another out")
        self.check_resumable(backend)
        saved = dict(resolve(self.config_table()))
        keys = [k for k in differences(saved, dict(config)) if k not in EXECUTION_KEYS]
        if keys:
            raise FileExistsError(
                f"results folder {self.root} holds an unfinished run of another config "
                f"(it differs in {', '.join(keys[:5])}); choose another out"
            )
        return True

    def set_status(self, status: str, **extra: Any) -> None:
        """Rewrite run.json (the digest of the config the run started with is kept)."""
        self.check_writable()
        kept: dict[str, Any] = {}
        if "config_sha256" not in extra and (self.root / "run.json").is_file():
            try:
                previous = self.status()
                kept = {key: previous[key] for key in ("config_sha256", "backend") if key in previous}
                kept["config_sha256"] = previous["config_sha256"]
            except (RuntimeError, KeyError):  # an unreadable run.json: the digest of the config the folder holds
                if self.has_config():
                    kept = {"config_sha256": config_digest(self.config_text(errors="replace"))}
        info = {
            "status": status,
            "pflkit_version": __version__,
            "records_format": RECORDS_FORMAT,
            "host": socket.gethostname(),
            "machine": machine(),
            "pid": os.getpid(),
            "updated": dt.datetime.now().isoformat(timespec="seconds"),
            **kept,
            **extra,
        }
        atomic_write_text(self.root / "run.json", json.dumps(info, indent=2) + "\n")

    def status(self) -> dict[str, Any]:
        if not self.has(RUN_FILE):
            raise FileNotFoundError(f"{self.root} is not a pflkit results folder (no run.json)")
        path = self.where(RUN_FILE)
        try:
            status = json.loads(self.read_bytes(RUN_FILE).decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RuntimeError(f"{path} is not valid JSON ({exc}): {self.root} is no readable pflkit run") from None
        if not isinstance(status, dict) or "status" not in status:
            raise RuntimeError(f"{path} holds no run status: {self.root} is no pflkit run")
        return status

    def check_resumable(self, backend: str = "simulator") -> None:
        """Refuse folders that are no pflkit run, hold records of another format
        (``RECORDS_FORMAT``: checkpoints and metrics would not mean the same), ran on another
        backend than ``backend`` (the simulator and Flower keep client states in different places)
        or are packed and unfinished (a packed folder is never written). Any pflkit version that
        writes the same records format continues a run."""
        status = self.status()
        if self.packed and status["status"] != "complete":
            raise PackedFolderError(
                f"{self.root} is packed but its run is not complete ({status['status']}): restore its "
                f"files first (pflkit unpack {self.root}), then continue it"
            )
        ran_on = status.get("backend", "simulator")
        if ran_on != backend:
            raise RuntimeError(
                f"{self.root} was run {BACKENDS.get(ran_on, ran_on)}; it continues only there "
                f"({RESUME_COMMANDS.get(ran_on, 'the same way')}), not {BACKENDS.get(backend, backend)}"
            )
        written = status.get("records_format", 1)
        if written != RECORDS_FORMAT:
            by = status.get("pflkit_version", "an unknown version")
            raise RuntimeError(
                f"{self.root} holds records of format {written!r} (written by pflkit {by}); this pflkit "
                f"({__version__}) writes format {RECORDS_FORMAT}: resume it with a pflkit that writes "
                f"format {written!r}, or start a new run"
            )
        if not self.has_config():
            raise FileNotFoundError(f"{self.root} has no config.toml: it cannot be resumed")
        digest = status.get("config_sha256")
        text = self.config_text(errors="replace")
        if digest is not None and digest != config_digest(text):
            raise RuntimeError(
                f"{self.config_path} was edited after the run started, so its checkpoints and "
                "metrics belong to another config: restore the file, or start a new run with the "
                f"edited config (pflkit run {self.config_path} --out NEW_FOLDER)"
            )

    def has_config(self) -> bool:
        """Whether the folder holds config.toml (plain, or in its archive)."""
        return self.has(CONFIG_FILE)

    def config_text(self, errors: str = "strict") -> str:
        """config.toml's text (plain, or from the archive of a packed folder); FileNotFoundError
        naming the folder where it holds none, UnicodeDecodeError (``errors="strict"``) where it is
        not UTF-8."""
        return self.read_bytes(CONFIG_FILE).decode("utf-8", errors=errors)

    def config_table(self) -> dict[str, Any]:
        """config.toml as saved (the resolved tables, neither validated nor warned about), or an
        error naming the file."""
        try:
            return tomllib.loads(self.config_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.where(CONFIG_FILE)} is not a readable config ({exc})") from None

    def load_config(self) -> BaseConfig:
        """config.toml validated, as ``pflkit.config.load_config`` reads a config file (a
        ConfigError names the file, or the archive that holds it)."""
        from ..config import ConfigError, load_config

        try:
            table = self.config_table()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return load_config(self.where(CONFIG_FILE), data=table)

    def records(self) -> list[dict[str, Any]]:
        """Every record of metrics.jsonl in the order written; none where the file does not exist."""
        if not self.has(self.metrics_path.name):
            return []
        return [json.loads(line) for line in self.read_bytes(self.metrics_path.name).decode("utf-8").splitlines()]

    def histories(self) -> dict[tuple[str, int], list[dict[str, Any]]]:
        """metrics.jsonl's records by run: (algorithm, seed) -> that run's records in order."""
        out: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for record in self.records():
            out.setdefault((record["algorithm"], int(record["seed"])), []).append(record)
        return out

    def summary(self) -> dict[str, Any]:
        """summary.json (written once every run finished), or an error naming the file."""
        name = self.summary_path.name
        if not self.has(name):
            raise FileNotFoundError(f"{self.summary_path} does not exist: the run has not finished")
        return parse_json_object(self.read_bytes(name), self.where(name))

    def has_summary(self) -> bool:
        """Whether summary.json exists (every run finished), plain or packed."""
        return self.has(self.summary_path.name)

    def append_record(self, record: Mapping[str, Any]) -> None:
        self.check_writable()
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def rewrite_metrics(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Make metrics.jsonl match the checkpoints exactly (drops rows after the last checkpoint)."""
        self.check_writable()
        atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in records))

    def config_sha256(self) -> str | None:
        """The digest of the config the folder's run started with (run.json), if recorded."""
        return self.status().get("config_sha256")

    def check_checkpoint(self, state: RunState, algorithm: str, seed: int) -> None:
        """Refuse a checkpoint that is another run's: another method or seed, or a run of another
        config than the folder's (a file copied in from elsewhere)."""
        digest = self.config_sha256()
        same_run = (state.algorithm, state.seed) == (algorithm, seed)
        if same_run and (state.config_sha256 is None or digest is None or state.config_sha256 == digest):
            return
        of = f"{state.algorithm} seed {state.seed}" + ("" if not same_run else " under another config")
        raise RuntimeError(
            f"checkpoint {self.checkpoint_path(algorithm, seed)} is the state of {of}, not of "
            f"{algorithm} seed {seed} of this folder's config: it was copied in from another run; "
            "remove it (that run then starts from round 0) or restore the right file"
        )

    def saved_histories(self, algorithms: Iterable[str], seeds: Iterable[int]) -> list[dict[str, Any]]:
        """The records every run's checkpoint holds, checked against metrics.jsonl before anything is
        rewritten: rows of a run whose checkpoint is missing, or that disagree with it, are refused,
        never dropped."""
        written = self.histories()
        records: list[dict[str, Any]] = []
        for seed in seeds:
            for alg in algorithms:
                path = self.checkpoint_path(alg, seed)
                rows = written.get((alg, int(seed)), [])
                history = []
                if path.is_file():
                    state = load_checkpoint(path)
                    self.check_checkpoint(state, alg, seed)
                    history = state.history
                if rows and not path.is_file():
                    raise RuntimeError(
                        f"{self.metrics_path} holds {len(rows)} records of {alg} seed {seed} but "
                        f"its checkpoint {path} is missing: resuming would drop them. Restore the "
                        "checkpoint, or start a new run"
                    )
                common = min(len(rows), len(history))
                if [_comparable(r) for r in rows[:common]] != [_comparable(r) for r in history[:common]]:
                    raise RuntimeError(
                        f"checkpoint {path} disagrees with the records of {alg} seed {seed} in "
                        f"{self.metrics_path}: one of them belongs to another run; restore the "
                        "folder's own files, or start a new run"
                    )
                records.extend(history)
        return records

    def partition_path(self, partition_seed: int) -> Path:
        return self.root / f"partition-seed{partition_seed}.json"

    def partition(self, partition_seed: int) -> dict[str, Any]:
        """partition-seed<k>.json: how the partition of ``partition_seed`` was drawn and each
        client's class counts, or an error naming the file."""
        name = self.partition_path(partition_seed).name
        if not self.has(name):
            raise FileNotFoundError(f"{self.root} holds no partition of partition seed {partition_seed} ({name})")
        return parse_json_object(self.read_bytes(name), self.where(name))

    def write_partition(self, partition_seed: int, record: Mapping[str, Any]) -> None:
        """The partition a run used: how it was drawn and every client's class counts."""
        self.check_writable()
        atomic_write_text(self.partition_path(partition_seed), json.dumps(record) + "\n")

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        self.check_writable()
        atomic_write_text(self.summary_path, json.dumps(summary, indent=2) + "\n")


class MetricsWriter:
    """Callback: append each record to the folder's metrics.jsonl."""

    def __init__(self, results: ResultsFolder) -> None:
        self.results = results

    def on_record(self, state: Any, record: Mapping[str, Any]) -> None:
        self.results.append_record(record)


class TensorBoardTracker:
    """Callback: every numeric field of a run's records as a TensorBoard scalar (tag = the field,
    step = the record's round) in the run's own TensorBoard run, ``<folder>/<algorithm>-seed<k>``:
    TensorBoard overlays the methods' and seeds' curves of one tag."""

    def __init__(self, folder: Path, algorithm: str, seed: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError(
                'tracker = "tensorboard" needs the tensorboard package: pip install '
                "'pflkit[tensorboard]' (or set tracker = \"none\")"
            ) from None
        self.log_dir = folder / tensorboard_run(algorithm, seed)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def on_record(self, state: Any, record: Mapping[str, Any]) -> None:
        step = int(record.get("train_round", record["round"]))
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("round", "seed"):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()
        if getattr(state, "done", False):  # the run's final record
            self.writer.close()


def tensorboard_run(algorithm: str, seed: int) -> str:
    """The TensorBoard run (a folder name) of one method and seed: ``fedala-seed0``; characters
    other than letters, digits and ``_.+-`` (an outside method's ``module:Class``) become ``_``."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", algorithm) + f"-seed{seed}"

"""Bad input over the command line: every case exits non-zero with one message that names the
problem, prints no traceback and leaves no summary.json behind."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.data import write_idx

FAST = ["dataset=synthetic", "num_clients=4", "alpha=0.5", "rounds=1", 'algorithms=["fedavg"]']


def mnist_folder(root: Path, n_train: int = 30, n_test: int = 10) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28), dtype=np.uint8))
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, n, dtype=np.uint8))
    return root


def mnist_args(root: Path) -> list[str]:
    return ["dataset=mnist", f"data_dir='{root}'", "num_clients=2", "rounds=1", 'algorithms=["fedavg"]']


def finished_run(tmp: Path) -> Path:
    out = tmp / "done"
    result = CliRunner().invoke(main, ["run", *FAST, "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def interrupted_run(tmp: Path) -> Path:
    out = finished_run(tmp)
    (out / "summary.json").unlink()
    (out / "run.json").write_text(json.dumps({"status": "failed", "pflkit_version": "0.1.0"}))
    return out


def pfllib_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"num_clients": 2, "num_classes": 10}))
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        (root / split).mkdir()
        for i in range(2):
            data = {"x": rng.normal(size=(12, 1, 16, 16)).astype(np.float32), "y": rng.integers(0, 10, 12)}
            np.savez_compressed(root / split / f"{i}.npz", data=data)
    return root


def _missing_label_file(tmp: Path) -> list[str]:
    root = mnist_folder(tmp / "mnist")
    (root / "t10k-labels-idx1-ubyte.gz").unlink()
    return ["run", *mnist_args(root)]


def _corrupt_gzip(tmp: Path) -> list[str]:
    root = mnist_folder(tmp / "mnist")
    path = root / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-30])
    return ["run", *mnist_args(root)]


def _truncated_idx(tmp: Path) -> list[str]:
    root = mnist_folder(tmp / "mnist")
    path = root / "train-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-100]))
    return ["run", *mnist_args(root)]


def _too_few_mnist_samples(tmp: Path) -> list[str]:
    root = mnist_folder(tmp / "mnist", n_train=3, n_test=0)
    return ["run", *mnist_args(root)[:-3], "num_clients=5", "rounds=1", 'algorithms=["fedavg"]']


def _config_file(text: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        path = tmp / "experiment.toml"
        path.write_text(text)
        return ["run", str(path)]

    return make


def _resume_other_records_format(tmp: Path) -> list[str]:
    out = interrupted_run(tmp)
    (out / "run.json").write_text(json.dumps({"status": "failed", "pflkit_version": "9.0.0", "records_format": 99}))
    return ["run", "--resume", str(out)]


def _resume_broken_run_json(tmp: Path) -> list[str]:
    out = interrupted_run(tmp)
    (out / "run.json").write_text("{not json")
    return ["run", "--resume", str(out)]


def _resume_broken_config(tmp: Path) -> list[str]:
    out = interrupted_run(tmp)
    (out / "config.toml").write_text((out / "config.toml").read_text() + "\nunknown_key = 3\n")
    return ["run", "--resume", str(out)]


def _resume_corrupt_checkpoint(tmp: Path) -> list[str]:
    out = interrupted_run(tmp)
    (out / "checkpoints" / "fedavg-seed0.pt").write_bytes(b"garbage")
    return ["run", "--resume", str(out)]


def _pfllib_missing_file(tmp: Path) -> list[str]:
    root = pfllib_folder(tmp / "pfl")
    (root / "test" / "1.npz").unlink()
    return ["run", "dataset=pfllib", f"data_dir='{root}'", "rounds=1", 'algorithms=["fedavg"]']


def _pfllib_broken_config(tmp: Path) -> list[str]:
    root = pfllib_folder(tmp / "pfl")
    (root / "config.json").write_text("{num_clients: 2")
    return ["run", "dataset=pfllib", f"data_dir='{root}'", "rounds=1", 'algorithms=["fedavg"]']


def _cifar_garbage_archive(tmp: Path) -> list[str]:
    (tmp / "cifar").mkdir()
    (tmp / "cifar" / "cifar-10-python.tar.gz").write_bytes(b"not an archive")
    return ["run", "dataset=cifar10", f"data_dir='{tmp / 'cifar'}'", "rounds=1"]


def _agnews_bad_row(tmp: Path) -> list[str]:
    (tmp / "ag").mkdir()
    (tmp / "ag" / "train.csv").write_text('"1","title only"\n')
    (tmp / "ag" / "test.csv").write_text('"2","a","b"\n')
    return ["run", "dataset=agnews", f"data_dir='{tmp / 'ag'}'", "rounds=1"]


def _existing_out(tmp: Path) -> list[str]:
    out = tmp / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    return ["run", *FAST, "--out", str(out)]


def _config_not_utf8(tmp: Path) -> list[str]:
    path = tmp / "latin1.toml"
    path.write_bytes('name = "d\xe9mo"\n'.encode("latin-1"))
    return ["config", str(path)]


def _config_is_a_folder(tmp: Path) -> list[str]:
    (tmp / "folder.toml").mkdir()
    return ["config", str(tmp / "folder.toml")]


def _sweep_file_with_bad_table(tmp: Path) -> list[str]:
    path = tmp / "sweep.toml"
    path.write_text('sweep = "lr"\n')
    return ["sweep", str(path), "--out", str(tmp / "sw")]


def _run_of_a_sweep_file(tmp: Path) -> list[str]:
    path = tmp / "sweep.toml"
    path.write_text("[sweep]\nlr = [0.1, 0.2]\n")
    return ["run", str(path)]


def _resume_edited_config(tmp: Path) -> list[str]:
    out = finished_run(tmp)
    path = out / "config.toml"
    path.write_text(path.read_text().replace("rounds = 1", "rounds = 10"))
    return ["run", "--resume", str(out)]


HELD_LOCKS: list[int] = []  # descriptors of locks a case holds, closed after the test


def _hold_lock(folder: Path) -> None:
    """Hold ``folder``'s lock as another process would (flock is per open file, so this process's
    own second attempt is refused as well)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"pflkit pid 4242 on host elsewhere since 2026-11-24T10:00:00\n")
    HELD_LOCKS.append(fd)


def _resume_while_running(tmp: Path) -> list[str]:
    out = interrupted_run(tmp)
    _hold_lock(out)
    return ["run", "--resume", str(out)]


def _run_into_a_busy_folder(tmp: Path) -> list[str]:
    _hold_lock(tmp / "busy")
    return ["run", *FAST, "--out", str(tmp / "busy")]


def _sweep_into_a_busy_folder(tmp: Path) -> list[str]:
    _hold_lock(tmp / "sw")
    return ["sweep", *FAST, "lr=[0.1,0.2]", "--out", str(tmp / "sw")]


def _sweep_cell_with_another_config(tmp: Path) -> list[str]:
    result = CliRunner().invoke(main, ["sweep", *FAST, "lr=[0.1]", "--out", str(tmp / "sw"), "--quiet"])
    assert result.exit_code == 0, result.output
    (tmp / "sw" / "lr=0.1" / "summary.json").unlink()  # unfinished, then the fixed overrides change
    return ["sweep", *FAST, "num_clients=5", "lr=[0.1]", "--out", str(tmp / "sw")]


def _missing_disk_state(tmp: Path) -> list[str]:
    out = tmp / "disk"
    result = CliRunner().invoke(main, ["run", *FAST, "state_store=disk", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    (out / "summary.json").unlink()
    next((out / "states" / "fedavg-seed0").glob("client*.pt")).unlink()
    return ["run", "--resume", str(out)]


def _report_on_a_list_summary(tmp: Path) -> list[str]:
    out = finished_run(tmp)
    (out / "summary.json").write_text("[1, 2]\n")
    return ["report", str(out), "--out", str(tmp / "rep")]


def _report_on_broken_summary(tmp: Path) -> list[str]:
    out = finished_run(tmp)
    (out / "summary.json").write_text("{broken")
    return ["report", str(out), "--out", str(tmp / "rep")]


def _report_outside_its_folder(tmp: Path) -> list[str]:
    return ["report", str(finished_run(tmp)), "--out", str(tmp / "rep"), "--name", "../../x"]


def _report_on_no_run(tmp: Path) -> list[str]:
    (tmp / "empty").mkdir()
    return ["report", str(tmp / "empty"), "--out", str(tmp / "rep")]


def _on_finished_run(*args: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        out = finished_run(tmp)
        return [word.replace("RUN", str(out)) for word in args]

    return make


def _out_is_a_file(tmp: Path) -> list[str]:
    (tmp / "file").write_text("x")
    return ["run", *FAST, "--out", str(tmp / "file")]


def _lock_is_a_link(tmp: Path) -> list[str]:
    (tmp / "precious.txt").write_text("keep me")
    (tmp / "results").mkdir()
    (tmp / "results" / ".lock").symlink_to(tmp / "precious.txt")
    return ["run", *FAST]


def _resume_without_checkpoint(tmp: Path) -> list[str]:
    out = interrupted_run(tmp)
    (out / "checkpoints" / "fedavg-seed0.pt").unlink()
    return ["run", "--resume", str(out)]


def _resume_with_foreign_checkpoint(tmp: Path) -> list[str]:
    other = tmp / "other"
    result = CliRunner().invoke(main, ["run", *FAST, "seeds=[1]", "--out", str(other), "--quiet"])
    assert result.exit_code == 0, result.output
    out = interrupted_run(tmp)
    (out / "checkpoints" / "fedavg-seed0.pt").write_bytes((other / "checkpoints" / "fedavg-seed1.pt").read_bytes())
    return ["run", "--resume", str(out)]


def _flower_simulation_folder(tmp: Path) -> list[str]:
    out = interrupted_run(tmp)
    status = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**status, "backend": "flower-simulation"}))
    return ["run", "--resume", str(out)]


def _pfllib_pickle_that_runs_code(tmp: Path) -> list[str]:
    root = pfllib_folder(tmp / "pfl")
    np.savez_compressed(root / "train" / "0.npz", data=np.array([Exploit()], dtype=object))
    return ["run", "dataset=pfllib", f"data_dir='{root}'", "rounds=1", 'algorithms=["fedavg"]']


class Exploit:
    """A pickle that would create a file when loaded."""

    def __reduce__(self):
        return (os.mkdir, ("/tmp/pflkit-pickle-ran",))


def _sweep_into_a_run(tmp: Path) -> list[str]:
    return ["sweep", *FAST, "lr=[0.1,0.2]", "--out", str(finished_run(tmp))]


def _download_over_garbage(tmp: Path) -> list[str]:
    (tmp / "mnist").mkdir()
    (tmp / "mnist" / "train-labels-idx1-ubyte.gz").write_bytes(b"half a download")
    return ["download", "mnist", str(tmp / "mnist")]


def _tampered_trace(tmp: Path) -> list[str]:
    out = tmp / "traced"
    result = CliRunner().invoke(main, ["run", *FAST, "trace.clients=[1]", "rounds=2", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    trace = next((out / "trace").rglob("client1-round1.pt"))
    trace.write_bytes(b"\x80\x04not a model")
    return ["plot", "trajectory", str(out), "--client", "1"]


def run_args(*overrides: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["run", *overrides]


# (case, arguments, what the message must say)
CASES: list[tuple[str, Callable[[Path], list[str]], str]] = [
    ("unknown key", run_args("colour=1"), "colour: unknown key"),
    ("misspelt key", run_args("num_client=3"), "did you mean 'num_clients'"),
    ("unknown section key", run_args("fedala.etaa=1.0"), "fedala.etaa: unknown key (did you mean 'eta'?)"),
    ("unknown section", run_args("fedalaa.eta=1.0"), "fedalaa: unknown key (did you mean 'fedala'?)"),
    ("wrong type", run_args('rounds="three"'), "rounds: Input should be a valid integer"),
    ("zero rounds", run_args("rounds=0"), "rounds: must be >= 1"),
    ("alpha zero", run_args("alpha=0.0"), "alpha: must be > 0"),
    ("train fraction 1", run_args("train_fraction=1.0"), "train_fraction: must be < 1"),
    ("join ratio above 1", run_args("join_ratio=1.5"), "join_ratio: must be <= 1"),
    ("unknown algorithm", run_args('algorithms=["fedsomething"]'), "unknown algorithm 'fedsomething'"),
    ("duplicate algorithms", run_args('algorithms=["fedavg","fedavg"]'), "algorithms contains duplicates"),
    ("no algorithms", run_args("algorithms=[]"), "algorithms: List should have at least 1 item"),
    ("duplicate seeds", run_args("seeds=[0,0]"), "seeds contains duplicates"),
    ("unknown partition", run_args("partition=random"), "partition: must be one of 'iid', 'dirichlet'"),
    ("unknown dataset", run_args("dataset=imagenet"), "dataset: must be one of"),
    ("unknown model", run_args("model=vgg"), "model: unknown model; available: auto"),
    ("bad device", run_args("device=tpu"), "device must be cpu, cuda, cuda:N or auto"),
    ("ALA without ALA target", run_args('algorithms=["fedfomo+ala"]'), "fedfomo downloads no single model"),
    (
        "FedBABU on a model without a body",
        run_args('algorithms=["fedbabu"]', "model=mclr"),
        "fedbabu trains the model's body with its head frozen: it needs a model of at least two units",
    ),
    (
        "FedPer on a model without a head",
        run_args('algorithms=["fedper"]', "model=mclr"),
        "this model has one, 'fc' (fc.weight, fc.bias) (model = 'mclr')",
    ),
    ("ALA on FedCP", run_args('algorithms=["fedcp+ala"]'), "'fedcp+ala' is undefined: the received head is FedCP's"),
    ("ALA on GPFL", run_args('algorithms=["gpfl+ala"]'), "'gpfl+ala' is undefined: GPFL's scored model reads"),
    ("ALA on FedAS", run_args('algorithms=["fedas+ala"]'), "'fedas+ala' is undefined: parameter alignment is"),
    (
        "ALA p beyond the model",
        run_args(*FAST, "fedala.p=9", 'algorithms=["fedala"]'),
        "fedala.p=9 exceeds this model's 4 units",
    ),
    (
        "cross-silo method with partial participation",
        run_args("join_ratio=0.5", 'algorithms=["fedamp"]'),
        "algorithm 'fedamp' needs every client in every round",
    ),
    ("file dataset without data_dir", run_args("dataset=mnist"), "dataset 'mnist' needs data_dir"),
    (
        "data_dir that does not exist",
        run_args("dataset=mnist", "data_dir=/no/such/folder"),
        "MNIST directory /no/such/folder does not exist",
    ),
    ("missing data file", _missing_label_file, "lacks t10k-labels-idx1-ubyte[.gz]"),
    ("corrupt gzip file", _corrupt_gzip, "t10k-images-idx3-ubyte.gz"),
    ("truncated IDX file", _truncated_idx, "train-images-idx3-ubyte.gz: IDX payload size mismatch"),
    (
        "config file missing",
        run_args("/no/such/experiment.toml"),
        "config file /no/such/experiment.toml does not exist",
    ),
    ("config file not TOML", _config_file("rounds = = 3\n"), "is not valid TOML"),
    ("config file with unknown key", _config_file("rounds = 2\n[fedala]\nnope = 1\n"), "fedala.nope: unknown key"),
    (
        "more clients than samples",
        run_args("num_clients=5000"),
        "dataset 'digits' (1797 samples, 10 classes): num_clients=5000 needs at least 10000 samples",
    ),
    (
        "minimum beyond the data",
        run_args("min_samples_per_client=200"),
        "num_clients=20 x min_samples_per_client=200 = 4000 samples, but the dataset holds 1797",
    ),
    (
        "unreachable minimum",
        run_args("alpha=0.001", "min_samples_per_client=80"),
        "no draw in 1000 tries gave every one of num_clients=20 clients min_samples_per_client=80 samples",
    ),
    (
        "client too small to split",
        run_args("num_clients=300", "alpha=0.5", "min_samples_per_client=1"),
        "too few to split into training and test data at train_fraction=0.75",
    ),
    (
        "simplex as large as the label set",
        run_args('algorithms=["sosicfl"]', "sosicfl.num_endpoints=10"),
        "sosicfl.num_endpoints=10 needs fewer simplex endpoints than the dataset's 10 labels",
    ),
    ("SosicFL subregion radius zero", run_args('algorithms=["sosicfl"]', "sosicfl.rho=0"), "sosicfl.rho"),
    (
        "pretrained weights missing",
        run_args("pretrained=/no/such/weights.pt"),
        "pretrained = '/no/such/weights.pt': no such file",
    ),
    (
        "no draw without an empty client",
        run_args("num_clients=300", "alpha=0.01", "min_samples_per_client=0"),
        "clients a sample (even min_samples_per_client=0 needs one) with alpha=0.01",
    ),
    ("dataset too small for its clients", _too_few_mnist_samples, "num_clients=5 needs at least 10 samples"),
    (
        "classes per client beyond the classes",
        run_args("partition=pathological", "classes_per_client=11"),
        "classes_per_client=11 must be in 1..10",
    ),
    (
        "pathological slots uncovered",
        run_args("partition=pathological", "num_clients=15", "classes_per_client=1"),
        "got no data",
    ),
    ("NaN loss", run_args(*FAST, "lr=1e12"), "training loss became nan (algorithm fedavg, client"),
    ("existing results folder", _existing_out, "already exists and is not empty"),
    ("resume of a folder that is no run", lambda tmp: ["run", "--resume", str(tmp)], "is not a pflkit results folder"),
    ("resume of another records format", _resume_other_records_format, "holds records of format 99"),
    ("resume with a broken run.json", _resume_broken_run_json, "run.json is not valid JSON"),
    ("resume with a broken config", _resume_broken_config, "its config.toml does not load"),
    ("resume with a corrupt checkpoint", _resume_corrupt_checkpoint, "fedavg-seed0.pt is unreadable"),
    ("resume with overrides", lambda tmp: ["run", "--resume", str(tmp), "rounds=3"], "--resume takes no CONFIG"),
    ("PFLlib folder missing a client file", _pfllib_missing_file, "lacks the files of 1 of them"),
    ("PFLlib config.json broken", _pfllib_broken_config, "config.json is not valid JSON"),
    ("CIFAR archive that is no archive", _cifar_garbage_archive, "cifar-10-python.tar.gz is not a readable .tar.gz"),
    ("AG News row with two fields", _agnews_bad_row, "train.csv, row 1: expected 3 fields"),
    ("download of an unknown dataset", lambda tmp: ["download", "imagenet", str(tmp / "d")], "no download for dataset"),
    ("bench with bad client counts", lambda tmp: ["bench", "--clients", "ten"], "expected comma-separated integers"),
    # results folders, sweeps, reports and plots
    ("config file not UTF-8", _config_not_utf8, "is not UTF-8 text (byte 9): TOML files are UTF-8"),
    ("config file that is a folder", _config_is_a_folder, "folder.toml is not a file"),
    ("config name with a path", run_args("name='../../x'"), "name: must be a plain folder name"),
    ("empty config name", run_args("name=''"), "name: String should have at least 1 character"),
    (
        "data_dir for a built-in dataset",
        run_args("data_dir=/data/mnist"),
        "data_dir is set ('/data/mnist') but dataset = 'digits' reads no files",
    ),
    ("two config files", run_args("a.toml", "b.toml"), "unexpected argument 'b.toml'"),
    ("run of a sweep file", _run_of_a_sweep_file, "has a [sweep] table: it is a sweep file"),
    ("results folder that is a file", _out_is_a_file, "is a file"),
    ("resume after config.toml was edited", _resume_edited_config, "config.toml was edited after the run started"),
    ("resume while the run still goes", _resume_while_running, "is in use by pflkit pid 4242 on host elsewhere"),
    ("run into a folder another process writes", _run_into_a_busy_folder, "is in use by pflkit pid 4242"),
    (
        "resume with a client state file missing",
        _missing_disk_state,
        "were deleted or the results folder was copied without its states/ folder. Copy them back, or delete",
    ),
    ("sweep into a folder another sweep writes", _sweep_into_a_busy_folder, "/sw is in use by pflkit pid 4242"),
    (
        "sweep metric that is no number",
        lambda tmp: ["sweep", *FAST, "lr=[0.1,0.2]", "--metric", "seeds", "--out", str(tmp / "sw")],
        "--metric 'seeds' is not a summary metric; choose from",
    ),
    (
        "sweep metric misspelt",
        lambda tmp: ["sweep", *FAST, "lr=[0.1,0.2]", "--metric", "best_acc", "--out", str(tmp / "sw")],
        "--metric 'best_acc' is not a summary metric",
    ),
    (
        "sweep cell beyond the model",
        lambda tmp: ["sweep", *FAST, 'algorithms=["fedala"]', "fedala.p=[1,99]", "--out", str(tmp / "sw")],
        "sweep cell fedala.p=99: fedala.p=99 exceeds this model's 4 units",
    ),
    (
        "sweep cell with a bad value",
        lambda tmp: ["sweep", *FAST, "rounds=[0,1]", "--out", str(tmp / "sw")],
        "sweep cell rounds=0: invalid configuration",
    ),
    (
        "sweep over equal values",
        lambda tmp: ["sweep", *FAST, "lr=[1,1.0]", "--out", str(tmp / "sw")],
        "sweep cells lr=1 and lr=1.0 are the same config",
    ),
    (
        "sweep over an empty list",
        lambda tmp: ["sweep", *FAST, "lr=[]", "--out", str(tmp / "sw")],
        "sweep over lr: the list of values is empty",
    ),
    (
        "sweep key given twice",
        lambda tmp: ["sweep", *FAST, "lr=[0.1]", "lr=[0.2]", "--out", str(tmp / "sw")],
        "sweep over lr is given twice",
    ),
    (
        "sweep without a list",
        lambda tmp: ["sweep", *FAST, "--out", str(tmp / "sw")],
        "needs at least one key with a list of values",
    ),
    ("sweep file whose [sweep] is no table", _sweep_file_with_bad_table, "[sweep] must be a table"),
    (
        "sweep cell run with another config",
        _sweep_cell_with_another_config,
        "was run with another config (it differs in partition.num_clients",
    ),
    (
        "sweep whose cells all diverge",
        lambda tmp: ["sweep", *FAST, "lr=[1e12,1e13]", "--out", str(tmp / "sw")],
        "sweep cell lr=1000000000000.0 failed: NonFiniteLossError: training loss became nan",
    ),
    (
        "sweep whose cells all diverge: the summary line",
        lambda tmp: ["sweep", *FAST, "lr=[1e12,1e13]", "--out", str(tmp / "sw")],
        "error: 2 of 2 cells failed (lr=1000000000000.0, lr=10000000000000.0)",
    ),
    ("report on a summary.json that is a list", _report_on_a_list_summary, "holds a JSON list, not the object"),
    ("report on a broken summary.json", _report_on_broken_summary, "summary.json is not valid JSON"),
    ("report written outside its folder", _report_outside_its_folder, "--name '../../x' must be a plain file name"),
    ("report of no folder", lambda tmp: ["report", "--out", str(tmp / "rep")], "needs at least one results"),
    ("report of a folder that is no run", _report_on_no_run, "is not a results folder (no config.toml)"),
    (
        "plot simplex with no points",
        _on_finished_run("plot", "simplex", "RUN", "--points", "0"),
        "Invalid value for '--points': 0 is not in the range x>=1",
    ),
    (
        "plot trajectory with no grid",
        _on_finished_run("plot", "trajectory", "RUN", "--client", "0", "--grid", "0"),
        "Invalid value for '--grid': 0 is not in the range x>=2",
    ),
    (
        "plot ala of a run without ALA",
        _on_finished_run("plot", "ala", "RUN"),
        "has no ALA method with recorded weights",
    ),
    ("bench with an unknown engine", lambda tmp: ["bench", "--engines", "loop,gpu"], "unknown engine(s) gpu"),
    (
        "sweep with Ray options but the local executor",
        lambda tmp: [
            "sweep",
            "lr=[0.1,0.2]",
            "--out",
            str(tmp / "s"),
            "--address",
            "127.0.0.1:1",
            "--max-retries",
            "1",
        ],
        "--address, --max-retries go(es) with --executor ray",
    ),
    (
        "run --resume on the Flower simulation",
        _on_finished_run("run", "--resume", "RUN", "--on", "flower-simulation"),
        "--resume continues a simulator run",
    ),
    (
        "run with a Ray address but the simulator",
        lambda tmp: ["run", "--ray-address", "127.0.0.1:1"],
        "--ray-address goes with --on flower-simulation",
    ),
    ("a results folder whose lock file is a link", _lock_is_a_link, "results/.lock is a symbolic link (to "),
    (
        "resume with a run's checkpoint missing",
        _resume_without_checkpoint,
        "holds 2 records of fedavg seed 0 but its checkpoint",
    ),
    (
        "resume with another run's checkpoint",
        _resume_with_foreign_checkpoint,
        "is the state of fedavg seed 1, not of fedavg seed 0",
    ),
    (
        "resume in the simulator of a Flower simulation",
        _flower_simulation_folder,
        "was run on Flower's Simulation Engine (pflkit run --on flower-simulation); it continues only there",
    ),
    ("a modifier applied twice", run_args('algorithms=["fedavg+ala+ala"]'), "applies +ala twice"),
    ("an alias modified again", run_args('algorithms=["fedala+ala"]'), "applies +ala twice"),
    ("a name with a newline", run_args('name="a\nb"'), "no path separators or control characters"),
    (
        "a plateau metric that is never recorded",
        run_args("plateau_evaluations=5", "plateau_metric=local_accuracy"),
        "plateau_metric = 'local_accuracy' is recorded only under test_set = \"official\"",
    ),
    (
        "a PFLlib file whose pickle runs code",
        _pfllib_pickle_that_runs_code,
        "its pickle calls posix.mkdir, which a PFLlib dataset never holds: refused",
    ),
    ("a sweep into a run's folder", _sweep_into_a_run, "is the results folder of a run (it holds run.json)"),
    (
        "download over a garbage file",
        _download_over_garbage,
        "train-labels-idx1-ubyte.gz is already there but is not the expected file",
    ),
    ("bench with no clients", lambda tmp: ["bench", "--clients", "0"], "client counts must be at least 1"),
    ("bench with no workers", lambda tmp: ["bench", "--workers", "0"], "'--workers': 0 is not in the range x>=1"),
    (
        "bench --scale with no participants",
        lambda tmp: ["bench", "--scale", "--participants", "0"],
        "'--participants': 0 is not in the range x>=1",
    ),
    (
        "bench on CUDA without CUDA",
        lambda tmp: ["bench", "--device", "cuda"],
        "device 'cuda' was requested but CUDA is not available",
    ),
    (
        "bench report into a missing folder",
        lambda tmp: ["bench", "--out", str(tmp / "no" / "bench.json")],
        "does not exist: create it first",
    ),
    (
        "plot ala of a client the run does not have",
        _on_finished_run("plot", "ala", "RUN", "--client", "99"),
        "--client 99 is not a client of",
    ),
    (
        "plot ala of a seed the run does not have",
        _on_finished_run("plot", "ala", "RUN", "--seed", "7"),
        "holds no records of seed 7; its seeds: 0",
    ),
    (
        "a batch larger than every client",
        run_args(*FAST, "batch_size=1000000000000"),
        "batch_size = 1000000000000 exceeds every client's training set",
    ),
    ("a thread count the machine cannot start", run_args("threads=1000000"), "threads: must be <= 1024"),
    (
        "a partition retry count without end",
        run_args("partition.max_retries=1000000000000"),
        "partition.max_retries: must be <= 100000",
    ),
    ("plot trajectory of a tampered trace file", _tampered_trace, "is not a model pflkit saved"),
    (
        "a run into a folder below a file",
        lambda tmp: (tmp / "f").write_text("x") and ["run", *FAST, "--out", str(tmp / "f" / "run")],
        "is a file: ",
    ),
    (
        "a sweep into a folder below a file",
        lambda tmp: (tmp / "f").write_text("x") and ["sweep", *FAST, "lr=[0.1,0.2]", "--out", str(tmp / "f" / "s")],
        "is a file: ",
    ),
    (
        "a report into a file",
        lambda tmp: (tmp / "f").write_text("x") and ["report", str(finished_run(tmp)), "--out", str(tmp / "f")],
        "is a file",
    ),
]


@pytest.mark.integration
@pytest.mark.parametrize("make_args,needle", [(a, n) for _, a, n in CASES], ids=[c for c, _, _ in CASES])
def test_bad_input_exits_with_one_clear_message(tmp_path, make_args, needle):
    if ("CUDA is not available" in needle or needle.startswith("device")) and torch.cuda.is_available():
        pytest.skip("CUDA is available")
    args = make_args(tmp_path)
    if args[0] == "run" and "--out" not in args and "--resume" not in args:
        args = [*args, "--out", str(tmp_path / "results")]
    summaries = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("summary.json")}  # a finished run's stay as they are
    try:
        result = CliRunner().invoke(
            main, [*args, "--quiet"] if args[0] in ("run", "sweep") and "--resume" not in args else args
        )
    finally:
        while HELD_LOCKS:
            os.close(HELD_LOCKS.pop())
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert needle in result.output, result.output
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("summary.json")} == summaries


def test_data_dir_may_name_an_environment_variable_and_an_unset_one_is_named(tmp_path, monkeypatch):
    """Committed result cells say data_dir = "${PFLKIT_DATA}/mnist": no machine's path."""
    from pflkit.data import DataError, write_idx
    from pflkit.data.sources import data_folder, load_dataset

    folder = tmp_path / "mnist"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 10)):
        write_idx(folder / f"{prefix}-images-idx3-ubyte", rng.integers(0, 255, (n, 28, 28), dtype=np.uint8))
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8))
    monkeypatch.setenv("PFLKIT_DATA", str(tmp_path))
    assert data_folder("${PFLKIT_DATA}/mnist") == folder
    assert len(load_dataset("mnist", "${PFLKIT_DATA}/mnist").y) == 40
    monkeypatch.delenv("PFLKIT_DATA")
    with pytest.raises(DataError, match="environment variable PFLKIT_DATA, which is not set"):
        load_dataset("mnist", "${PFLKIT_DATA}/mnist")

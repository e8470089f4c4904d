"""state_store = "disk": client states in files, bounded cache, atomic writes, checkpoints and
resume on the same files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from pflkit.config import load_config
from pflkit.federation.checkpoint import load_checkpoint
from pflkit.federation.state_store import DiskStateStore
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.support.runs import KILL_AFTER, records_without_timings


def made(i: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), float(i))}


def test_round_trip_through_files_with_a_bounded_cache(tmp_path) -> None:
    store = DiskStateStore(tmp_path, 5, made, cache=2)
    assert torch.equal(store[3]["w"], made(3)["w"]) and not list(tmp_path.iterdir())  # made, never written
    for i in range(5):
        store[i] = {"w": torch.arange(3.0) + 10 * i, "nested": {"n": torch.tensor([i])}}
    assert len(store._cache) == 2  # the least recently used states live on disk only
    fresh = DiskStateStore(tmp_path, 5, made, cache=1).restore(store.snapshot())
    for i in range(5):
        assert torch.equal(fresh[i]["w"], torch.arange(3.0) + 10 * i) and fresh[i]["nested"]["n"].item() == i
    with pytest.raises(KeyError):
        store[5]


def test_writes_are_atomic_and_restore_drops_versions_after_the_checkpoint(tmp_path, monkeypatch) -> None:
    store = DiskStateStore(tmp_path, 2, made, cache=1)
    store[0] = {"w": torch.ones(3)}
    snapshot = store.snapshot()
    store.prune()

    def killed(src, dst):  # the process dies between writing the temporary file and renaming it
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        store[0] = {"w": torch.zeros(3)}
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # torn file left behind
    store[1] = {"w": torch.full((3,), 7.0)}  # written after the checkpoint: a resumed run redoes it
    fresh = DiskStateStore(tmp_path, 2, made, cache=1).restore(snapshot)
    assert torch.equal(fresh[0]["w"], torch.ones(3)) and torch.equal(fresh[1]["w"], made(1)["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client0-v1.pt"]


@pytest.mark.integration
def test_disk_store_gives_the_memory_stores_numbers(tmp_path, fast_config) -> None:
    overrides = fast_config + ['algorithms=["fedala", "ditto"]', "rounds=3", "join_ratio=0.5"]
    run_experiment(load_config(None, overrides), tmp_path / "memory", progress=False, echo=lambda s: None)
    run_experiment(
        load_config(None, overrides + ["state_store=disk", "state_cache=1"]),
        tmp_path / "disk",
        progress=False,
        echo=lambda s: None,
    )
    assert records_without_timings(tmp_path / "disk") == records_without_timings(tmp_path / "memory")
    files = sorted(p.name for p in (tmp_path / "disk" / "states" / "fedala-seed0").iterdir())
    assert files and all(f.startswith("client") and f.endswith(".pt") for f in files)
    saved = torch.load(tmp_path / "disk" / "checkpoints" / "fedala-seed0.pt", weights_only=True)
    assert saved["clients"] == {} and len(saved["client_store"]["versions"]) == len(files)  # no second copy
    # a loaded checkpoint reads its clients from their files (what pflkit plot simplex does)
    disk = load_checkpoint(tmp_path / "disk" / "checkpoints" / "ditto-seed0.pt").clients
    memory = load_checkpoint(tmp_path / "memory" / "checkpoints" / "ditto-seed0.pt").clients
    assert sorted(disk) == sorted(c for c in memory if c in disk) and len(disk) >= 2
    for c in disk:
        assert all(torch.equal(disk[c]["personal"][k], memory[c]["personal"][k]) for k in memory[c]["personal"])


@pytest.mark.integration
def test_kill_9_then_resume_with_the_disk_store_equals_an_uninterrupted_run(tmp_path, fast_config) -> None:
    # checkpoints every 2 rounds: the kill after round 3 leaves state files newer than the checkpoint
    overrides = fast_config + ['algorithms=["fedala"]', "rounds=5", "checkpoint_every=2", "state_store=disk"]
    run_experiment(load_config(None, overrides), tmp_path / "full", progress=False, echo=lambda s: None)
    out = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER, str(out), *overrides], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    resume_experiment(out, progress=False, echo=lambda s: None)
    assert records_without_timings(out) == records_without_timings(tmp_path / "full")

"""The parallel engine's worker threads, and a Flower node's message handlers, run with the run's
intra-op thread count from their first operation on. A fresh thread's OpenMP team otherwise has
OMP_NUM_THREADS until torch first sets it, and oneDNN's convolutions read it before that: a client
evaluated first on a worker summed in another order than the same client on a warmed-up thread (a
resumed run's scores moved in the last bits)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

LIBGOMP = Path(torch.__file__).parent / "lib" / "libgomp.so.1"

SCRIPT = textwrap.dedent(
    f"""
    import ctypes
    import torch
    from pflkit.engines.executor import ClientExecutor

    gomp = ctypes.CDLL({str(LIBGOMP)!r})
    torch.set_num_threads(1)
    executor = ClientExecutor("probe", workers=2)
    print([executor._pool.submit(gomp.omp_get_max_threads).result() for _ in range(4)])
    """
)


@pytest.mark.skipif(not LIBGOMP.exists(), reason="this torch build does not ship GNU OpenMP")
def test_worker_threads_start_with_the_callers_thread_count():
    env = {"OMP_NUM_THREADS": "3", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1, 1, 1, 1]", out.stdout


NODE_SCRIPT = textwrap.dedent(
    f"""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    import tomli_w
    from pflkit.config import load_config, to_dict
    from pflkit.flower.node import node_run, node_setup

    gomp = ctypes.CDLL({str(LIBGOMP)!r})
    config = load_config(None, ["dataset=synthetic", "num_clients=3", "threads=1"])
    text = tomli_w.dumps(to_dict(config))
    node_setup(text, {{"partition-id": 0}}, 0)  # built (and cached) on the main thread

    def message():
        node_run(text, {{"partition-id": 0}}, "fedavg", 0)
        return gomp.omp_get_max_threads()

    with ThreadPoolExecutor(2) as pool:  # messages handled on threads that did not build the setup
        print([pool.submit(message).result() for _ in range(4)])
    """
)


@pytest.mark.skipif(not LIBGOMP.exists(), reason="this torch build does not ship GNU OpenMP")
def test_a_flower_node_message_on_another_thread_runs_with_the_nodes_thread_count():
    pytest.importorskip("flwr")
    env = {"OMP_NUM_THREADS": "3", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", NODE_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[1, 1, 1, 1]", out.stdout

"""One experiment on Flower's Simulation Engine: pflkit's ServerApp and ClientApp as virtual
SuperNodes on a Ray backend, on this machine or on the Ray cluster at ``ray_address``.

The same apps as a real deployment (``flower/server_app.py``, ``flower/client_app.py``), the same
records as the simulator. Each of the config's ``num_clients`` clients is a virtual SuperNode
(``partition-id`` = its client id) that holds its data partition and keeps its client state in the
node's ``context.state`` for the run, or, with ``state_store = "disk"`` (many stateful clients), in a
file under the results folder's ``states/flower/`` (the nodes' memory then holds none). A client
reserves ``run.threads`` CPUs, and one GPU when ``run.device`` is CUDA. Flower's ``flwr[simulation]``
needs Ray (``pip install -e '.[ray]' in a pflkit clone``). Flower's own log goes to ``flower.log`` in the results
folder; the terminal shows pflkit's lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..config import BaseConfig, ConfigError
from ..federation import ResultsFolder
from ..federation.network import local_ray_access, prepare_ray, ray_keeps_signal_handlers
from ..federation.stopping import signal_handlers_kept
from .client_app import app as client_app
from .logs import FLOWER_LOG, flower_log_in
from .server import check_flower_config, check_simulation_resumable, run_on_flower


def client_resources(config: BaseConfig) -> dict[str, float]:
    """What one virtual SuperNode reserves on the Ray backend."""
    return {"num_cpus": float(config.run.threads), "num_gpus": 1.0 if config.run.device.startswith("cuda") else 0.0}


def run_on_flower_simulation(
    config: BaseConfig, out: str | Path, *, ray_address: str | None = None, timeout: float | None = None
) -> dict[str, Any]:
    """Run ``config`` into ``out`` on Flower's Simulation Engine; return the summary (the same
    results folder, records and figures as ``pflkit run``; resumable like a Flower run)."""
    check_flower_config(config, simulation=True)
    folder = ResultsFolder(out)
    if folder.has("run.json") and folder.status().get("status") != "complete":
        check_simulation_resumable(config, folder)  # before Ray starts
    try:
        import ray  # noqa: F401  (flwr's Ray backend)
    except ImportError:
        raise ConfigError(
            "--on flower-simulation needs Flower's Ray backend: pip install -e '.[ray]' in a pflkit clone"
        ) from None
    prepare_ray(ray_address)
    summary: dict[str, Any] = {}
    errors: list[BaseException] = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            summary.update(run_on_flower(config, grid, out, timeout=timeout, wait_seconds=120.0, simulation=True))
        except BaseException as exc:  # Flower logs and swallows the ServerApp's errors: keep it for the caller
            errors.append(exc)
            if isinstance(exc, KeyboardInterrupt):  # a stop (the folder says so): end the ServerApp quietly
                return
            raise

    init_args: dict[str, Any] = {"include_dashboard": False, "logging_level": "ERROR"}
    if ray_address:
        init_args["address"] = ray_address
    # Ray's SIGTERM handler outlives the simulation otherwise; a Ray started here takes a token
    with (
        flower_log_in(folder.root / FLOWER_LOG),
        signal_handlers_kept(),
        ray_keeps_signal_handlers(),
        local_ray_access(ray_address) as access,
    ):
        from flwr.simulation import run_simulation  # (its import logs too)

        backend_config: dict[str, dict[str, Any]] = {
            "client_resources": client_resources(config),
            "init_args": {**init_args, **access},
        }
        run_simulation(server, client_app, num_supernodes=config.partition.num_clients, backend_config=backend_config)
    if errors:
        raise errors[0]
    if not summary:
        raise RuntimeError(f"the Flower simulation ended without the run's summary (see {folder.root / FLOWER_LOG})")
    return summary

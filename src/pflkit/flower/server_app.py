"""The pflkit ServerApp. Run config keys (``[tool.flwr.app.config]`` or ``flwr run -c``):

config-file   path of an experiment TOML on the SuperLink host ("" = the digits demo)
overrides     space-separated key=value overrides, as on the pflkit command line
out           results folder (written on the host that runs the ServerApp)
timeout       seconds to wait for one round's replies (0 or absent: the experiment's [run] reply_timeout)
wait-seconds  seconds to wait for the SuperNodes to connect
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..config import load_config, split_overrides
from .server import run_on_flower

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = context.run_config
    config = load_config(
        str(run_config.get("config-file", "")) or None, split_overrides(str(run_config.get("overrides", "")))
    )
    run_on_flower(
        config,
        grid,
        str(run_config.get("out", "results/flower")),
        timeout=float(run_config.get("timeout", 0.0)) or None,
        wait_seconds=float(run_config.get("wait-seconds", 120.0)),
    )

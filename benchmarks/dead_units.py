"""Find the clients whose network has collapsed (docs/papers/fedala.md, FedGH): for each client's
parameter sets in a run's checkpoint, run its training split through the model unit by unit and
report, after each unit, the share of output elements that are positive on at least one sample
(``live``) and the largest standard deviation of an element over the samples (``spread``).

A unit whose ``live`` share is 0 passes no gradient back (every ReLU is off on every sample), so
the units below it stop learning for good; a ``spread`` of 0 after the body means that every image
gets the same features and the client predicts one class, whatever its head. Such a client's
accuracy is the share of that class in its test split.

    PFLKIT_DATA=../shared/datasets python benchmarks/dead_units.py \\
        RESULTS_FOLDER --algorithm fedgh --seed 1

RESULTS_FOLDER is a run's folder with its config.toml and checkpoints/ (checkpoints are not
committed: rerun the cell with ``pflkit run <cell>/config.toml --out RESULTS_FOLDER``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from pflkit.federation.checkpoint import load_checkpoint
from pflkit.functional.training import forward
from pflkit.models.base import UnitModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from score_states import full_sets, load_run


def unit_activity(model: UnitModel, params: dict[str, torch.Tensor], x: torch.Tensor) -> list[dict[str, Any]]:
    """``live`` share and ``spread`` of each unit's output over the samples ``x`` (evaluation mode)."""
    rows = []
    with torch.no_grad():
        for stop, (unit, _) in enumerate(model.units(), start=1):
            h = forward(model, params, x, stop=stop).flatten(1)
            rows.append(
                {
                    "unit": unit,
                    "live": (h > 0).any(0).float().mean().item(),
                    "spread": h.std(0).max().item() if len(h) > 1 else 0.0,
                }
            )
    return rows


def dead_units(folder: Path, algorithm: str, seed: int) -> dict[str, Any]:
    """Per client and per client parameter set of the checkpoint of (algorithm, seed) in ``folder``,
    the units' activity on the client's training split, with the dead units named."""
    _, data, model, init, checkpoint = load_run(folder, algorithm, seed)
    names = {n for n, _ in model.named_parameters()}
    state = load_checkpoint(checkpoint)
    clients: dict[str, Any] = {}
    for client in data.clients:
        client_state = state.clients.get(client.client_id)
        if client_state is None:
            raise KeyError(f"{checkpoint} holds no state for client {client.client_id}")
        for key, value in full_sets(client_state, names).items():
            units = unit_activity(model, {**init, **value}, client.train_x)
            # the last unit is the head: its logits need not be positive to carry gradient
            dead = [u["unit"] for u in units[:-1] if u["live"] == 0.0]
            clients.setdefault(str(client.client_id), {})[key] = {
                "dead_units": dead,
                "constant_features": len(units) > 1 and units[-2]["spread"] == 0.0,
                "units": units,
            }
    collapsed = sorted(
        (cid for cid, sets in clients.items() if any(s["dead_units"] or s["constant_features"] for s in sets.values())),
        key=lambda cid: (len(cid), cid),
    )
    return {"rounds_done": state.rounds_done, "collapsed_clients": collapsed, "clients": clients}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a run's results folder (config.toml, checkpoints/)")
    parser.add_argument("--algorithm", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(dead_units(args.folder, args.algorithm, args.seed), indent=1))


if __name__ == "__main__":
    main()

"""Score every model a run's checkpoint holds on its clients' test splits (docs/results-intro.md,
pFedMe): each client state's full parameter sets (pFedMe's local w "model" and personalised theta
"personal", Ditto's global-track and personal models, ...) and the server's, pooled over clients
as the run's ``accuracy`` is (correct over all test samples). It answers "would another choice of
scored model move the number?" without rerunning the cell.

    PFLKIT_DATA=../shared/datasets python benchmarks/score_states.py \\
        RESULTS_FOLDER --algorithm pfedme --seed 0

RESULTS_FOLDER is a run's folder with its config.toml and checkpoints/ (a cell rerun with
``pflkit run <cell>/config.toml --out RESULTS_FOLDER``; checkpoints are not committed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from pflkit.config import load_config
from pflkit.federation.checkpoint import load_checkpoint
from pflkit.federation.preparation import build_partitions, initial_params, partition_seed
from pflkit.functional.training import evaluate


def full_sets(state: dict[str, Any], names: set[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The entries of ``state`` that are complete parameter sets of the model (every name in ``names``)."""
    return {
        key: value
        for key, value in state.items()
        if isinstance(value, dict) and names <= set(value) and all(torch.is_tensor(value[n]) for n in names)
    }


def score_states(folder: Path, algorithm: str, seed: int) -> dict[str, Any]:
    """Pooled test accuracy of every parameter set in the checkpoint of (algorithm, seed) in ``folder``."""
    config = load_config(folder / "config.toml")
    checkpoint = folder / "checkpoints" / f"{algorithm}-seed{seed}.pt"
    if not checkpoint.is_file():
        raise FileNotFoundError(f"{checkpoint} does not exist: score_states needs the run's checkpoint")
    config, partitions = build_partitions(config, torch.device("cpu"))
    data = partitions[partition_seed(config, seed)]
    model, init = initial_params(config, data, seed, torch.device("cpu"))
    names = {n for n, _ in model.named_parameters()}
    state = load_checkpoint(checkpoint)
    counts: dict[str, list[int]] = {}
    for client in data.clients:
        client_state = state.clients.get(client.client_id)
        if client_state is None:
            raise KeyError(f"{checkpoint} holds no state for client {client.client_id}: its models cannot be scored")
        sets = {f"client {key}": value for key, value in full_sets(client_state, names).items()}
        sets.update({f"server {key}": value for key, value in full_sets(state.server, names).items()})
        for label, params in sets.items():
            result = evaluate(model, {**init, **params}, client.test_x, client.test_y)
            tally = counts.setdefault(label, [0, 0])
            tally[0] += result["correct"]
            tally[1] += result["num_samples"]
    return {
        "rounds_done": state.rounds_done,
        "accuracy": {label: correct / total for label, (correct, total) in counts.items()},
        "test_samples": next(iter(counts.values()))[1] if counts else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a run's results folder (config.toml, checkpoints/)")
    parser.add_argument("--algorithm", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(score_states(args.folder, args.algorithm, args.seed), indent=2))


if __name__ == "__main__":
    main()

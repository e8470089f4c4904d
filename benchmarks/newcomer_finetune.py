"""Rebuild the newcomers of a run's last evaluation and look inside them (docs/scenarios.md,
pFedMe): each unseen client receives what the method gives a newcomer from the checkpoint's final
server state and is fine-tuned as the run fine-tuned it (``[run] unseen_finetune_epochs`` and
``unseen_finetune_lr``, the run's train settings, the same batch stream), or at another learning
rate (``--lr``). For each it reports the test accuracy before and after the fine-tuning (with the
run's own lr the latter must equal the last record's: the script checks it), the class it predicts
most and the share of its test images given that class, and the units that are off on every
training image before and after the fine-tuning (``benchmarks/dead_units.py``).

    PFLKIT_DATA=../shared/datasets python benchmarks/newcomer_finetune.py \\
        RESULTS_FOLDER --algorithm pfedme --seed 0 [--lr 0.01]

RESULTS_FOLDER is a finished run's folder with its config.toml and checkpoints/ (checkpoints are
not committed: rerun the cell with ``pflkit run <cell>/config.toml --out RESULTS_FOLDER``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from pflkit.engines.base import RoundSetup
from pflkit.engines.executor import finetuned
from pflkit.federation.checkpoint import load_checkpoint
from pflkit.federation.runner import newcomers
from pflkit.functional.training import forward
from pflkit.methods import build_algorithm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dead_units import unit_activity
from score_states import load_run


def newcomer_finetune(folder: Path, algorithm: str, seed: int, lr: float | None = None) -> dict[str, Any]:
    """Per unseen client of the finished run (algorithm, seed) in ``folder``: the fine-tuned
    newcomer's accuracy, its most predicted class and that class's share, and its dead units."""
    if lr is not None and not lr > 0:
        raise ValueError(f"--lr must be positive, got {lr}")
    config, data, model, init, checkpoint = load_run(folder, algorithm, seed)
    state = load_checkpoint(checkpoint)
    if not state.done:
        raise ValueError(f"{checkpoint} is not a finished run's: its newcomers were not scored on its last state")
    unseen = newcomers(config, init)
    if unseen is None:
        raise ValueError(f"{folder / 'config.toml'} has no unseen clients ([run] unseen_clients)")
    method = build_algorithm(algorithm, config.algorithm_sections(), config.train, model.units())
    setup = RoundSetup(method, data, model, model.units(), config.train, seed)
    final = state.rounds_done + 1  # the final pass's round: the newcomers' batch streams depend on it
    recorded = next(r for r in reversed(state.history) if "unseen_client_accuracy" in r)
    clients: dict[str, Any] = {}
    for job in unseen.jobs(method, state.server, final):
        job = job.loaded()
        ctx = setup.context(job.client_id, final)
        local, _ = method.local_init(job.payload, job.state, ctx)
        received = {**init, **method.eval_params(local)}
        tuned, _ = finetuned(
            method,
            method.eval_params(local),
            ctx,
            job.finetune or 0,
            job.finetune_steps,
            job.finetune_lr if lr is None else lr,
        )
        params = {**init, **tuned}
        (result,) = ctx.evaluate(params)
        (before,) = ctx.evaluate(received)
        client = data.client(job.client_id)
        with torch.no_grad():
            predicted = forward(model, params, client.test_x).argmax(1)
        counts = torch.bincount(predicted, minlength=data.num_classes)
        units = unit_activity(model, params, client.train_x)
        accuracy = result["correct"] / result["num_samples"]
        if lr is None and accuracy != recorded["unseen_client_accuracy"][str(job.client_id)]:
            raise AssertionError(
                f"client {job.client_id}: rebuilt newcomer scores {accuracy}, the run recorded "
                f"{recorded['unseen_client_accuracy'][str(job.client_id)]}: the rebuild is not the run's"
            )
        clients[str(job.client_id)] = {
            "received_accuracy": before["correct"] / before["num_samples"],
            "received_dead_units": [
                u["unit"] for u in unit_activity(model, received, client.train_x)[:-1] if u["live"] == 0.0
            ],
            "accuracy": accuracy,
            "most_predicted_class": int(counts.argmax()),
            "most_predicted_share": counts.max().item() / len(predicted),
            "dead_units": [u["unit"] for u in units[:-1] if u["live"] == 0.0],
        }
    return {
        "round": recorded["round"],
        "lr": (unseen.finetune_lr or config.train.lr) if lr is None else lr,
        "clients": clients,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a finished run's results folder (config.toml, checkpoints/)")
    parser.add_argument("--algorithm", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="fine-tune at this lr instead of the run's (unseen_finetune_lr, else its lr)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(newcomer_finetune(args.folder, args.algorithm, args.seed, args.lr), indent=2))


if __name__ == "__main__":
    main()

"""Score every model a run's checkpoint holds on its clients' test splits (docs/papers/fedala.md,
pFedMe): each client state's full parameter sets (pFedMe's local w "model" and personalised theta
"personal", Ditto's global-track and personal models, ...) and the server's, pooled over clients
as the run's ``accuracy`` is (correct over all test samples), with the lowest and highest
client's accuracy beside it (``client_accuracy_range``). It answers "would another choice of
scored model move the number?" without rerunning the cell.

For a method that keeps part of the model on the client (FedBN's batch norm, FedPer's head, ...)
it also scores each client set with what the downlink carries of the server's model put in
("client model + server shared"). That is the scored model of FedBN, FedPer and FedRep; a method
with its own receive or scoring rule (GPFL, FedGH, FedAS, ...) may score another. Where the server
keeps a part of the model per client (FedPAC's combined heads), it scores the server's global model
with that part put in ("server global + server KEY", FedPAC's scored model) and, beside it, with the
client's own head put in ("server global + client KEY head"): it tells what the server's per-client
part does against the head the client trained. ``--recalibrate-bn`` adds,
for a model with batch norm, every set with its running statistics recomputed on the client's
training split under the set's own weights: it tells stale statistics from bad weights.

    PFLKIT_DATA=../shared/datasets python benchmarks/score_states.py \\
        RESULTS_FOLDER --algorithm pfedme --seed 0
    PFLKIT_DATA=../shared/datasets python benchmarks/score_states.py \\
        RESULTS_FOLDER --algorithm fedbn --seed 0 --recalibrate-bn

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
from pflkit.functional.training import evaluate, forward
from pflkit.methods import build_algorithm
from pflkit.models import head_names, norm_layers
from pflkit.models.resnet import BN_MOMENTUM

#: label suffix of a set scored with recomputed batch-norm statistics
RECALIBRATED = " (batch-norm statistics recomputed)"


def full_sets(state: dict[str, Any], names: set[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The entries of ``state`` that are complete parameter sets of the model (every name in ``names``)."""
    return {
        key: value
        for key, value in state.items()
        if isinstance(value, dict) and names <= set(value) and all(torch.is_tensor(value[n]) for n in names)
    }


def per_client_parts(server: dict[str, Any], names: set[str], client_id: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The server entries that hold, for ``client_id``, a part of the model (FedPAC's combined heads):
    dicts keyed by client id whose value for this client maps some of ``names`` to tensors."""
    out = {}
    for key, value in server.items():
        part = value.get(client_id) if isinstance(value, dict) else None
        if isinstance(part, dict) and part and set(part) <= names and all(torch.is_tensor(t) for t in part.values()):
            out[key] = part
    return out


def recalibrated(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``params`` with every batch-norm layer's running mean and variance replaced by the mean and
    (unbiased) variance of that layer's input over all of ``x`` under these weights.

    One training-mode forward of ``x`` as a single batch: each layer then normalises with the
    batch's statistics, and the functional batch norm moves the running ones from zero by
    ``BN_MOMENTUM`` toward them, so dividing by it gives them. The split goes through as one batch,
    without augmentation: memory grows with its size (about 2 GB of first-layer activations for
    10,000 MNIST images on ``fedbn_cnn``)."""
    out = {k: v.clone() for k, v in params.items()}
    layers = norm_layers(out)
    for layer in layers:
        out[f"{layer}.running_mean"].zero_()
        out[f"{layer}.running_var"].zero_()
    with torch.no_grad():
        forward(model, out, x, train=True)
    for layer in layers:
        out[f"{layer}.running_mean"] /= BN_MOMENTUM
        out[f"{layer}.running_var"] /= BN_MOMENTUM
    return out


def load_run(folder: Path, algorithm: str, seed: int) -> tuple[Any, Any, Any, dict[str, torch.Tensor], Path]:
    """The run's config, its clients' data, the model with its initial parameters, and the path of
    the checkpoint of (algorithm, seed), which must exist."""
    config = load_config(folder / "config.toml")
    checkpoint = folder / "checkpoints" / f"{algorithm}-seed{seed}.pt"
    if not checkpoint.is_file():
        raise FileNotFoundError(f"{checkpoint} does not exist: reading a run's models needs its checkpoint")
    config, partitions = build_partitions(config, torch.device("cpu"))
    data = partitions[partition_seed(config, seed)]
    model, init = initial_params(config, data, seed, torch.device("cpu"))
    return config, data, model, init, checkpoint


def score_states(folder: Path, algorithm: str, seed: int, *, recalibrate_bn: bool = False) -> dict[str, Any]:
    """Pooled test accuracy of every parameter set in the checkpoint of (algorithm, seed) in ``folder``."""
    config, data, model, init, checkpoint = load_run(folder, algorithm, seed)
    names = {n for n, _ in model.named_parameters()}
    head = head_names(model.units())
    method = build_algorithm(algorithm, config.algorithm_sections(), config.train, model.units())
    if recalibrate_bn and not norm_layers(init):
        raise ValueError(f"--recalibrate-bn: {type(model).__name__} has no batch-norm layers to recalibrate")
    state = load_checkpoint(checkpoint)
    server_sets = full_sets(state.server, names)
    counts: dict[str, list[int]] = {}
    per_client: dict[str, list[float]] = {}
    for client in data.clients:
        client_state = state.clients.get(client.client_id)
        if client_state is None:
            raise KeyError(f"{checkpoint} holds no state for client {client.client_id}: its models cannot be scored")
        client_sets = full_sets(client_state, names)
        sets = {f"client {key}": {**init, **value} for key, value in client_sets.items()}
        sets.update({f"server {key}": {**init, **value} for key, value in server_sets.items()})
        received = sets.get("server global")  # the server's model as a client receives it
        if received is not None and method.personal_part is not None:
            shared = {k: received[k] for k in method.downloaded_names(list(received))}
            sets.update({f"client {key} + server shared": {**sets[f"client {key}"], **shared} for key in client_sets})
        parts = per_client_parts(state.server, names, client.client_id) if received is not None else {}
        sets.update({f"server global + server {key}": {**received, **part} for key, part in parts.items()})
        if parts:
            sets.update(
                {
                    f"server global + client {key} head": {**received, **{n: value[n] for n in head}}
                    for key, value in client_sets.items()
                }
            )
        if recalibrate_bn:
            sets.update(
                {label + RECALIBRATED: recalibrated(model, p, client.train_x) for label, p in list(sets.items())}
            )
        for label, params in sets.items():
            result = evaluate(model, params, client.test_x, client.test_y)
            tally = counts.setdefault(label, [0, 0])
            tally[0] += result["correct"]
            tally[1] += result["num_samples"]
            per_client.setdefault(label, []).append(result["correct"] / result["num_samples"])
    return {
        "rounds_done": state.rounds_done,
        "accuracy": {label: correct / total for label, (correct, total) in counts.items()},
        "client_accuracy_range": {label: [min(accs), max(accs)] for label, accs in per_client.items()},
        "test_samples": next(iter(counts.values()))[1] if counts else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a run's results folder (config.toml, checkpoints/)")
    parser.add_argument("--algorithm", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--recalibrate-bn",
        action="store_true",
        help="also score every set with its batch-norm statistics recomputed on the client's training split",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        json.dumps(score_states(args.folder, args.algorithm, args.seed, recalibrate_bn=args.recalibrate_bn), indent=2)
    )


if __name__ == "__main__":
    main()

"""How far tests/run/test_golden.py's numbers move under a changed reduction order and under small
changes of the maths: the measurement behind its tolerances.

    python benchmarks/golden_spread.py

Prints, for each variant of the golden run, the largest relative deviation of the losses and of
the parameter checksums from the frozen numbers, and the largest absolute accuracy deviation.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "run"))
from test_golden import CHECKSUMS, OVERRIDES, RECORDS

from pflkit.config import load_config
from pflkit.federation import ResultsFolder
from pflkit.run.experiment import run_experiment

VARIANTS = {
    "as frozen": [],
    "threads=2": ["threads=2"],
    "engine=vmap": ["engine=vmap"],
    "engine=parallel workers=2": ["engine=parallel", "workers=2"],
    "lr 0.05 -> 0.0501": ["lr=0.0501"],
    "momentum 0 -> 0.001": ["momentum=0.001"],
    "fedala.eta 1.0 -> 0.99": ["fedala.eta=0.99"],
}


def total(params: dict[str, torch.Tensor]) -> float:
    return sum(float(v.double().sum()) for v in params.values())


def deviations(extra: list[str]) -> dict[str, float]:
    """Largest relative loss and checksum deviation, largest accuracy deviation, from the golden numbers."""
    with tempfile.TemporaryDirectory() as folder:
        run_experiment(load_config(None, OVERRIDES + extra), folder, progress=False, echo=lambda s: None)
        records = ResultsFolder(folder).records()
        loss = accuracy = sums = 0.0
        for r in records:
            acc, test_loss, train_loss = RECORDS[(r["algorithm"], r["round"])]
            accuracy = max(accuracy, abs(r["accuracy"] - acc))
            loss = max(loss, abs(r["test_loss"] - test_loss) / test_loss)
            if train_loss is not None:
                loss = max(loss, abs(r["train_loss"] - train_loss) / train_loss)
        for name, (server_sum, client_sums) in CHECKSUMS.items():
            checkpoint = torch.load(Path(folder) / "checkpoints" / f"{name}-seed0.pt", weights_only=True)
            sums = max(
                sums,
                abs(total(checkpoint["server"]["global"]) - server_sum) / abs(server_sum),
                *(abs(total(checkpoint["clients"][i]["model"]) - s) / abs(s) for i, s in enumerate(client_sums)),
            )
    return {"losses_rel": loss, "checksums_rel": sums, "accuracy_abs": accuracy}


def main() -> None:
    torch.set_num_threads(1)
    logging.getLogger("pflkit").setLevel(logging.ERROR)  # ALA's start-phase cap warnings
    print(f"{'variant':<28} {'losses (rel)':>12} {'sums (rel)':>12} {'accuracy':>10}")
    for name, extra in VARIANTS.items():
        d = deviations(extra)
        print(f"{name:<28} {d['losses_rel']:>12.2e} {d['checksums_rel']:>12.2e} {d['accuracy_abs']:>10.2e}", flush=True)


if __name__ == "__main__":
    main()

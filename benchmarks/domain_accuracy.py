"""Accuracy by domain: a cell's pooled test accuracy over each group of clients that share a domain
(rotated MNIST's angles, a tint, a noise level), at the round of the cell's best accuracy. A cell
without feature shift is grouped by another cell's domains (``--domains-of``): the same clients
in Table 7 and in rotated MNIST (same partition seed, same class counts) tell what the rotation
costs each group.

    python benchmarks/domain_accuracy.py docs/results/rotated-mnist-gpu/algorithms=fedavg,seeds=0
    python benchmarks/domain_accuracy.py docs/results/fedala-table7-mnist/algorithms=fedavg,seeds=0 \\
        --domains-of docs/results/rotated-mnist-gpu/algorithms=fedavg,seeds=0

Pooled as the run's ``accuracy`` is: the group's correct predictions over its test samples (each
client's accuracy weighted by its test split's size, from the partition record).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pflkit.federation import ResultsFolder
from pflkit.federation.preparation import partition_seed


def partition_of(folder: ResultsFolder) -> dict[str, Any]:
    """The partition record of the cell's (single) seed."""
    seeds = {int(r["seed"]) for r in folder.records()}
    if len(seeds) != 1:
        raise SystemExit(f"{folder.root}: a cell of one seed expected, found seeds {sorted(seeds)}")
    return folder.partition(partition_seed(folder.load_config(), seeds.pop()))


def domain_labels(partition: dict[str, Any]) -> list[str]:
    """Each client's domain label; one label for all clients when the partition has no domains."""
    domains = partition.get("domains")
    if not domains:
        return ["all"] * int(partition["num_clients"])
    return [str(d["label"]) for d in domains]


def accuracy_by_domain(cell: Path, domains_of: Path | None = None) -> dict[str, Any]:
    """{"best_round", "accuracy", "domains": {label: pooled accuracy}} at the cell's best round, in %."""
    folder = ResultsFolder(cell)
    partition = partition_of(folder)
    labels = domain_labels(partition_of(ResultsFolder(domains_of)) if domains_of else partition)
    sizes = [sum(counts) for counts in partition["test_class_counts"]]
    if len(labels) != len(sizes):
        raise SystemExit(f"{cell}: {len(sizes)} clients, but the domains give {len(labels)}")
    evaluated = [r for r in folder.records() if "client_accuracy" in r]
    if not evaluated:
        raise SystemExit(f"{cell}: no evaluated round with per-client accuracies")
    best = max(evaluated, key=lambda r: r["accuracy"])
    per_client = best["client_accuracy"]
    out: dict[str, float] = {}
    for label in dict.fromkeys(labels):
        clients = [i for i, lab in enumerate(labels) if lab == label and str(i) in per_client]
        total = sum(sizes[i] for i in clients)
        out[label] = 100 * sum(per_client[str(i)] * sizes[i] for i in clients) / total
    return {"best_round": best["round"], "accuracy": 100 * best["accuracy"], "domains": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", nargs="+", type=Path, help="results folders (packed or plain)")
    parser.add_argument("--domains-of", type=Path, help="group the clients by this cell's domains")
    args = parser.parse_args()
    for cell in args.cells:
        found = accuracy_by_domain(cell, args.domains_of)
        groups = ", ".join(f"{label} {acc:.2f}" for label, acc in found["domains"].items())
        print(f"{cell.parent.name}/{cell.name}: best {found['accuracy']:.2f} at round {found['best_round']}; {groups}")


if __name__ == "__main__":
    main()

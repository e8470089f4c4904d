"""Accuracy by domain: a cell's pooled test accuracy over each group of clients that share a domain
(rotated MNIST's angles, a tint, a noise level), at the round of the cell's best accuracy (the
first such round on a tie, as the summary's best round). A cell without feature shift is grouped by
another cell's domains (``--domains-of``): the same clients in Table 7 and in rotated MNIST (same
partition, checked by the clients' test class counts) tell what the rotation costs each group.

    python benchmarks/domain_accuracy.py docs/results/rotated-mnist-gpu/algorithms=fedavg,seeds=0
    python benchmarks/domain_accuracy.py docs/results/fedala-table7-mnist/algorithms=fedavg,seeds=0 \\
        --domains-of docs/results/rotated-mnist-gpu/algorithms=fedavg,seeds=0

Pooled as the run's ``accuracy`` is: the group's correct predictions over its test samples (each
client's accuracy weighted by its test split's size, from the partition record). The groups must
pool back to the record's accuracy, which holds where every client is scored on its own test split;
a client not scored in that round (one that never trains, or one left out of the evaluation) is
refused, as is a partition whose clients' test splits are not what the record scored.
"""

from __future__ import annotations

import argparse
import math
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
    labels = domain_labels(partition)
    if domains_of is not None:
        other = partition_of(ResultsFolder(domains_of))
        if other["test_class_counts"] != partition["test_class_counts"]:
            raise SystemExit(f"{cell} and {domains_of}: the clients' test class counts differ (another partition)")
        labels = domain_labels(other)
    sizes = [sum(counts) for counts in partition["test_class_counts"]]
    evaluated = [r for r in folder.records() if "client_accuracy" in r]
    if not evaluated:
        raise SystemExit(f"{cell}: no evaluated round with per-client accuracies")
    best = max(evaluated, key=lambda r: r["accuracy"])  # max keeps the first of equal rounds
    per_client = best["client_accuracy"]
    missing = [i for i in range(len(sizes)) if str(i) not in per_client]
    if missing:
        raise SystemExit(
            f"{cell}: clients {missing} are not scored in round {best['round']}; their domains have no accuracy"
        )
    correct = {i: per_client[str(i)] * sizes[i] for i in range(len(sizes))}
    if not math.isclose(sum(correct.values()) / sum(sizes), best["accuracy"], abs_tol=1e-9):
        raise SystemExit(
            f"{cell}: the clients' accuracies do not pool to the record's accuracy (not client test splits?)"
        )
    out: dict[str, float] = {}
    for label in dict.fromkeys(labels):
        clients = [i for i, lab in enumerate(labels) if lab == label]
        out[label] = 100 * sum(correct[i] for i in clients) / sum(sizes[i] for i in clients)
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

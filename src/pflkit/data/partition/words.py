"""A partition in a few words, for plot titles and reports: the method with the parameter that tells
its settings apart, and the quantity skew and IID share where set."""

from __future__ import annotations

from .spec import PartitionSpec

__all__ = ["partition_words"]


def partition_words(spec: PartitionSpec) -> str:
    """E.g. ``dirichlet (alpha 0.1)``, ``shards (2 per client), lognormal sizes (sigma 1), 20% iid``."""
    detail = {
        "dirichlet": f"alpha {spec.alpha}",
        "label_dirichlet": f"alpha {spec.alpha}",
        "pathological": f"{spec.classes_per_client} classes per client",
        "kfold": f"{spec.num_folds} folds",
        "shards": f"{spec.shards_per_client} per client",
        "exdir": f"{spec.classes_per_client} classes per client, alpha {spec.alpha}",
        "matrix": "given counts",
    }.get(spec.method)
    words = [f"{spec.method} ({detail})" if detail else spec.method]
    if spec.quantity == "lognormal":
        words.append(f"lognormal sizes (sigma {spec.quantity_sigma:g})")
    elif spec.quantity != "partition":
        words.append(f"{spec.quantity} sizes")
    if spec.iid_share > 0:
        words.append(f"{spec.iid_share:.0%} iid")
    return ", ".join(words)

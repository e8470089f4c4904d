"""Evaluation on the CPU in 64-row chunks against one forward per evaluation batch: samples a
second and page faults a sample, alternating, medians (docs/explanations/performance.md).

    python benchmarks/eval_chunks.py --repeats 5

FedAvgCNN on four MNIST-shaped test splits of 875 samples (a client's split in FedALA's MNIST
setting), evaluation batch 1,000, one thread. ``whole`` is the forward over each evaluation batch
at once, as pflkit ran it before; ``chunked`` is :func:`pflkit.functional.training.in_row_chunks`.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from pflkit.functional import training
from pflkit.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--split", type=int, default=875, help="test samples per client")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_model("fedavg_cnn", (1, 28, 28), 10)
    params = {k: v.detach() for k, v in net.named_parameters()}
    splits = [(torch.randn(args.split, 1, 28, 28), torch.randint(0, 10, (args.split,))) for _ in range(4)]
    samples = 4 * args.split
    default_rows = training.CPU_FEATURE_ROWS
    scores: dict[str, list[dict[str, float]]] = {}

    def evaluate_all() -> list[dict[str, float]]:
        return [training.evaluate(net, params, x, y, 1000) for x, y in splits]

    rates: dict[str, list[float]] = {"whole": [], "chunked": []}
    faults: dict[str, int] = {"whole": 0, "chunked": 0}
    for _ in range(args.repeats):
        for mode, rows in (("whole", 10**9), ("chunked", default_rows)):
            training.CPU_FEATURE_ROWS = rows
            evaluate_all()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            scores[mode] = evaluate_all()
            rates[mode].append(samples / (time.perf_counter() - start))
            faults[mode] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    training.CPU_FEATURE_ROWS = default_rows
    for mode in rates:
        print(
            f"{mode:8s} {statistics.median(rates[mode]):7.0f} samples/s, "
            f"{faults[mode] / args.repeats / samples:5.1f} page faults a sample"
        )
    print(f"chunked / whole: {statistics.median(rates['chunked']) / statistics.median(rates['whole']):.2f}x")
    print(f"same scores: {scores['whole'] == scores['chunked']}")


if __name__ == "__main__":
    main()

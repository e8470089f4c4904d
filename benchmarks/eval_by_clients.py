"""Evaluation cost of the same test samples split over 1, 100, 1,000 and 10,000 clients
(docs/explanations/performance.md): one FedAvgCNN, 1 thread, client counts alternating, medians of 3.

    python benchmarks/eval_by_clients.py
"""

from __future__ import annotations

import statistics
import time

import torch

from pflkit.functional.training import evaluate
from pflkit.models import build_model


def main(samples: int = 17_500, repeats: int = 3) -> None:
    torch.set_num_threads(1)
    model = build_model("fedavg_cnn", (1, 28, 28), 10)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(samples, 1, 28, 28), torch.randint(0, 10, (samples,))

    def run(clients: int) -> float:
        per = samples // clients
        start = time.perf_counter()
        for i in range(clients):
            evaluate(model, params, x[i * per : (i + 1) * per], y[i * per : (i + 1) * per], 1000)
        return time.perf_counter() - start

    times: dict[int, list[float]] = {k: [] for k in (1, 100, 1000, 10000)}
    for rep in range(repeats):
        for k in list(times) if rep % 2 == 0 else list(reversed(times)):
            times[k].append(run(k))
    for k, v in times.items():
        print(f"{k:>6} clients: {statistics.median(v):.2f} s for {samples} test samples")


if __name__ == "__main__":
    main()

"""FedAvgCNN's batch-10 training step on one CPU thread, eager against ``torch.compile`` (forward
and backward), alternating, median milliseconds a step.

    python benchmarks/compile_step.py --repeats 7 --steps 100
    python benchmarks/compile_step.py --profile     # the eager step's operators instead (PyTorch's profiler)

Both models start from the same weights and take plain SGD steps (lr 0.1) on the same random
MNIST-shaped batches; the compiled one is warmed up (compiled) first, and the time that takes is
printed too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from pflkit.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per repeat and setting")
    parser.add_argument("--profile", action="store_true", help="profile --steps eager steps by operator and shape")
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2000, 1, 28, 28, generator=g), torch.randint(0, 10, (2000,), generator=g)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model("fedavg_cnn", (1, 28, 28), 10)

    eager, compiled = model(), model()
    runs = {"eager": (eager, eager), "compiled": (compiled, torch.compile(compiled))}

    def step(net: torch.nn.Module, forward: torch.nn.Module, i: int) -> None:
        start = i * 10 % len(y)
        loss = F.cross_entropy(forward(x[start : start + 10]), y[start : start + 10])
        grads = torch.autograd.grad(loss, list(net.parameters()))
        with torch.no_grad():
            torch._foreach_add_(list(net.parameters()), grads, alpha=-0.1)

    if args.profile:
        for i in range(20):
            step(eager, eager, i)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            for i in range(args.steps):
                step(eager, eager, i)
        table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15)
        print(f"{args.steps} eager steps:\n{table}")
        return
    t0 = time.perf_counter()
    for i in range(3):
        step(*runs["compiled"], i)
    print(f"compilation and 3 warm-up steps: {time.perf_counter() - t0:.1f} s")
    for i in range(3):
        step(*runs["eager"], i)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (net, forward) in runs.items():
            t = time.perf_counter()
            for i in range(args.steps):
                step(net, forward, i)
            ms[name].append((time.perf_counter() - t) / args.steps * 1e3)
    for name, values in ms.items():
        print(f"{name:9s} {statistics.median(values):7.3f} ms a step (median of {args.repeats})")
    print(f"eager / compiled: {statistics.median(ms['eager']) / statistics.median(ms['compiled']):.2f}x")


if __name__ == "__main__":
    main()

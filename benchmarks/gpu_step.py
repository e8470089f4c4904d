"""Where a batched training step's time goes, and what replaying it as a CUDA graph saves.

    python benchmarks/gpu_step.py --device cuda --clients 20 --steps 100

K clients of MNIST-shaped data (random 1x28x28 inputs, equal sizes, so every step runs all K) train
one epoch of batch-10 steps of FedAvgCNN through the engine's own batched context: eagerly (the
``vmap`` engine) and, on CUDA, with the steps replayed as CUDA graphs (``vmap-graphs``). The two
alternate ``--repeats`` times; the script prints the median milliseconds per step of each, their
ratio, how far the graphs' parameters are from the eager ones, and then the profiler's table of
one eager epoch: the operators by their own CPU time, with the kernel launches and host
synchronisations a step makes (``--profile-rows``). On the CPU only the eager half runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pflkit.algorithms import TrainSettings
from pflkit.data.federated import ClientData, FederatedData
from pflkit.engines.batched import BatchedClientContext
from pflkit.engines.graphs import CudaGraphRecorder
from pflkit.engines.stacking import stack
from pflkit.functional import classification_loss
from pflkit.models import build_model


def contexts(clients: int, steps: int, device: torch.device) -> tuple[dict, dict[str, BatchedClientContext]]:
    g = torch.Generator().manual_seed(0)
    parts = []
    for i in range(clients):
        n = steps * 10
        x, y = torch.randn(n + 10, 1, 28, 28, generator=g), torch.randint(0, 10, (n + 10,), generator=g)
        parts.append(ClientData(i, x[:n].to(device), y[:n].to(device), x[n:].to(device), y[n:].to(device)))
    fed = FederatedData.from_clients(parts, 10, "mnist-shaped")
    torch.manual_seed(0)
    model = build_model("fedavg_cnn", (1, 28, 28), 10)
    params = stack([{k: v.detach() for k, v in model.named_parameters()}] * clients, device)
    train = TrainSettings(batch_size=10, local_epochs=1, lr=0.1)
    make = lambda graphs: BatchedClientContext(  # noqa: E731
        list(range(clients)), 1, 0, fed, model, model.units(), train, "fedavg", graphs=graphs
    )
    out = {"vmap": make(None)}
    if device.type == "cuda":
        out["vmap-graphs"] = make(CudaGraphRecorder)
    return params, out


def timed(ctx: BatchedClientContext, params: dict, device: torch.device) -> tuple[float, dict]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fit = ctx.fit(params, classification_loss)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, fit.params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100, help="batch-10 steps in each client's epoch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile-rows", type=int, default=25, help="rows of the profiler's table (0: no profile)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    params, ctxs = contexts(args.clients, args.steps, device)
    for ctx in ctxs.values():  # warm-up: kernels chosen, allocator filled
        timed(ctx, params, device)
    seconds: dict[str, list[float]] = {name: [] for name in ctxs}
    results = {}
    for _ in range(args.repeats):
        for name, ctx in ctxs.items():
            t, results[name] = timed(ctx, params, device)
            seconds[name].append(t)
    print(f"{args.clients} clients, {args.steps} steps of batch 10 each, {device}; median of {args.repeats}:")
    base = statistics.median(seconds["vmap"]) / args.steps
    for name, ts in seconds.items():
        per_step = statistics.median(ts) / args.steps
        print(f"  {name:12s} {1e3 * per_step:8.3f} ms a step  ({base / per_step:.2f}x vmap)")
    if "vmap-graphs" in results:
        gap = max(float((results["vmap-graphs"][k] - results["vmap"][k]).abs().max()) for k in params)
        print(f"  largest difference of a parameter, graphs against eager: {gap:.3g}")
        counts = ctxs["vmap-graphs"].graph_counts
        print("  graphs' steps: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    if args.profile_rows:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            timed(ctxs["vmap"], params, device)
        events = prof.key_averages()
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))
        per_step = {
            e.key: e.count / args.steps
            for e in events
            if e.key in ("cudaLaunchKernel", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")
        }
        print("per eager step:", ", ".join(f"{k} x{v:.1f}" for k, v in sorted(per_step.items())) or "no CUDA calls")


if __name__ == "__main__":
    main()

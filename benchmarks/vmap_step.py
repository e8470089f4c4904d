"""One SGD step of K clients' FedAvgCNNs three ways: torch.func's vmap (what the vmap engine runs),
one grouped-convolution / batched-matmul network under plain autograd, and a loop over clients.

    python benchmarks/vmap_step.py --device cuda --clients 20 --batch 10

Why: on an H200 a vmapped step of 20 MNIST clients took ~6.8 ms against ~1.6 ms for one client's
step in the loop engine (derived from the bench's round times, docs/explanations/performance.md, "GPU"), so the
vmap engine's round is bound by its per-step overhead, not by arithmetic. The grouped network does
the same arithmetic in one kernel per layer for all clients with ordinary autograd; if its step is
much cheaper on a GPU, a batched forward per model is worth adding to the engine. The script first
checks that the three give the same gradients, then prints the median time per step of each
(settings alternate, 1 CPU thread).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.func import grad_and_value, vmap
from torch.nn import functional as F

from pflkit.functional.training import forward
from pflkit.models import build_model

Params = dict[str, torch.Tensor]


def grouped_forward(p: Params, x: torch.Tensor) -> torch.Tensor:
    """FedAvgCNN for K clients at once: ``p`` holds [K, ...] parameters, ``x`` [K, B, 1, 28, 28]."""
    k, b = x.shape[:2]
    h = x.transpose(0, 1).reshape(b, k * x.shape[2], *x.shape[3:])
    for conv in ("conv1", "conv2"):
        w = p[f"{conv}.weight"]
        h = F.conv2d(h, w.reshape(-1, *w.shape[2:]), p[f"{conv}.bias"].reshape(-1), groups=k)
        h = F.relu(F.max_pool2d(h, 2))
    h = h.reshape(b, k, -1).transpose(0, 1)
    h = F.relu(torch.baddbmm(p["fc1.bias"].unsqueeze(1), h, p["fc1.weight"].transpose(1, 2)))
    return torch.baddbmm(p["fc.bias"].unsqueeze(1), h, p["fc.weight"].transpose(1, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per setting and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for name in ("clients", "batch", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device, k = torch.device(args.device), args.clients
    model = build_model("fedavg_cnn", (1, 28, 28), 10).to(device)
    start = {n: t.detach() for n, t in model.named_parameters()}
    stacked = {
        n: t.unsqueeze(0).repeat(k, *([1] * t.dim())) + 0.01 * torch.randn(k, *t.shape, device=device)
        for n, t in start.items()
    }
    x = torch.randn(k, args.batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (k, args.batch), device=device)

    def loss(p: Params, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(forward(model, p, xs), ys)

    vmapped = vmap(grad_and_value(loss))

    def grouped_grads(p: Params) -> Params:
        out = grouped_forward(p, x)
        per_client = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none")
        total = per_client.reshape(k, -1).mean(1).sum()
        return dict(zip(p, torch.autograd.grad(total, list(p.values()))))

    # the check compares the three ways in full float32: TF32 convolutions (cuDNN's default on
    # CUDA) differ from one another by about 1e-3; the timings below keep the default. Without
    # TF32 an H200's kernels still sum in other orders: up to 3.6e-5 apart on 0.1% of the elements
    atol = 1e-5 if device.type == "cpu" else 1e-4
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    reference, _ = vmapped(stacked, x, y)
    leaves = {n: t.clone().requires_grad_() for n, t in stacked.items()}
    grouped = grouped_grads(leaves)
    one = {n: t[0].clone().requires_grad_() for n, t in stacked.items()}
    looped = dict(zip(one, torch.autograd.grad(loss(one, x[0], y[0]), list(one.values()))))
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    for name in stacked:
        torch.testing.assert_close(grouped[name], reference[name], rtol=1e-4, atol=atol)
        torch.testing.assert_close(looped[name], reference[name][0], rtol=1e-4, atol=atol)
    print(f"gradients agree ({k} clients, batch {args.batch}, {device})")

    def vmap_step() -> None:
        grads, _ = vmapped(stacked, x, y)
        with torch.no_grad():
            for n in stacked:
                stacked[n].sub_(0.01 * grads[n])

    def grouped_step() -> None:
        grads = grouped_grads(leaves)
        with torch.no_grad():
            for n in leaves:
                leaves[n].sub_(0.01 * grads[n])

    clients = [{n: t[i].clone().requires_grad_() for n, t in stacked.items()} for i in range(k)]

    def loop_step() -> None:
        for i, p in enumerate(clients):
            grads = torch.autograd.grad(loss(p, x[i], y[i]), list(p.values()))
            with torch.no_grad():
                for t, g in zip(p.values(), grads):
                    t.sub_(0.01 * g)

    settings: dict[str, Callable[[], None]] = {"vmap": vmap_step, "grouped": grouped_step, "loop": loop_step}
    times: dict[str, list[float]] = {name: [] for name in settings}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.repeats):
        for name, step in settings.items():
            for _ in range(3):
                step()
            sync()
            begin = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            times[name].append((time.perf_counter() - begin) / args.steps)
    base = statistics.median(times["vmap"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:8s} {1000 * median:8.2f} ms a step of {k} clients  ({base / median:.2f}x vmap's speed)")


if __name__ == "__main__":
    main()

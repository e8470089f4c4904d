"""ALA for K clients at once (the vmap engine), with the same maths and streams as ``ala.py``.

Clients are sorted by size, so at every mini-batch step the clients that still have a batch
form a prefix of the running set. Clients whose start phase converges leave the active set
while the others go on; clients without a new global model (first round) are left untouched.
Models with buffers (batch norm) are not supported here: the engines run ALA client by client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.func import grad_and_value, vmap
from torch.nn import functional as F

from ..functional import NonFiniteLossError, Params, forward
from ..models import buffer_names
from .ala import weight_step

if TYPE_CHECKING:
    from ..algorithms.base import State
    from ..engines.vmap import BatchedContext
    from .ala import AdaptiveLocalAggregation


def batched_ala(ala: "AdaptiveLocalAggregation", received: Params, local: Params, state: "State",
                ctx: "BatchedContext") -> tuple[Params, "State", dict[str, Any]]:
    if buffer_names(ctx.model):
        raise NotImplementedError(f"batched ALA does not support models with buffers (batch norm: "
                                  f"{type(ctx.model).__name__}); run ALA client by client")
    K = len(ctx.clients)
    lowest_top, top = ala.top_units(received)
    same = torch.ones(K, dtype=torch.bool, device=ctx.device)
    for k in received:
        same &= (received[k] == local[k]).flatten(1).all(1)
    fixed = {**local, **{k: v for k, v in received.items() if k not in top}}
    local_top = {k: local[k].detach() for k in top}
    delta = {k: received[k].detach() - local_top[k] for k in top}
    weights = {k: w.clone() for k, w in state["weights"].items()}
    started = state["started"].clone()
    epochs = torch.zeros(K)
    active = (~same).nonzero().flatten().tolist()
    if active:
        trained, counts = _learn_weights(ala, ctx, active, fixed, local_top, delta, weights,
                                         ~started[active].cpu(), lowest_top)
        for name in top:
            weights[name][active] = trained[name]
        started[active] = True
        epochs[active] = counts
    initialised = {**fixed, **{k: local_top[k] + delta[k] * weights[k] for k in top}}
    return ({k: initialised[k] for k in local}, {"weights": weights, "started": started},
            {"ala_epochs": epochs})


def _learn_weights(ala: "AdaptiveLocalAggregation", ctx: "BatchedContext", active: list[int], fixed: Params,
                   local_top: Params, delta: Params, weights: Params, start_phase: torch.Tensor,
                   lowest_top: int) -> tuple[Params, torch.Tensor]:
    """Train W of the ``active`` clients; returns their weights and epoch counts."""
    device, b, eta = ctx.device, ctx.train.batch_size, ala.settings.eta
    samples = [ctx.clients[k].train_rows[ala.sample_indices(ctx.clients[k].num_train, ctx.generator("ala", k))
                                          .to(device)] for k in active]
    steps = torch.tensor([(len(r) + b - 1) // b for r in samples])
    width = int(steps.max()) * b
    A = len(active)
    rows = torch.zeros(A, width, dtype=torch.long, device=device)
    mask = torch.zeros(A, width, device=device)
    for i, r in enumerate(samples):
        rows[i, :len(r)] = r
        mask[i, :len(r)] = 1.0
    sel = torch.tensor(active, device=device)
    fixed_a = {k: v[sel] for k, v in fixed.items()}
    prefix = ala.prefix_stop(ctx.model, lowest_top)
    feats = _features(ctx, fixed_a, rows, [len(r) for r in samples], prefix)
    labels = ctx.fed.y[rows]
    model = ctx.model
    closed = ala.closed_form(model, prefix, list(weights))
    if closed:  # targets of the closed-form step: one-hot / batch size, zero on padding
        counts = mask.view(A, -1, b).sum(2, keepdim=True).clamp(min=1)
        scale = (mask.view(A, -1, b) / counts).view(A, width, 1)
        targets = F.one_hot(labels, local_top[list(weights)[1]].shape[-1]).to(feats.dtype) * scale

    def loss_fn(blended: Params, fixed_p: Params, h: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        logits = forward(model, {**fixed_p, **blended}, h, start=prefix, train=True)
        return (F.cross_entropy(logits, y, reduction="none") * m).sum() / m.sum()

    step = vmap(grad_and_value(loss_fn))
    w = {k: weights[k][sel] for k in weights}
    lt = {k: v[sel] for k, v in local_top.items()}
    dl = {k: v[sel] for k, v in delta.items()}
    losses: list[list[float]] = [[] for _ in active]
    running = list(range(A))
    while running:
        run = torch.tensor(running, device=device)
        w_r = {k: v[run] for k, v in w.items()}
        lt_r, dl_r = {k: v[run] for k, v in lt.items()}, {k: v[run] for k, v in dl.items()}
        fx_r = {k: v[run] for k, v in fixed_a.items()}
        steps_r = steps[run.cpu()]
        last = torch.zeros(len(running), device=device)
        for j in range(int(steps_r.max())):
            n = int((steps_r > j).sum())  # a prefix: sizes are sorted
            cols = slice(j * b, (j + 1) * b)
            blended = {k: torch.addcmul(lt_r[k][:n], dl_r[k][:n], w_r[k][:n]) for k in w_r}
            if closed:
                (wn, bn) = list(w_r)
                loss, gw, gb = _linear_head_steps(feats[run[:n], cols], targets[run[:n], cols],
                                                  scale[run[:n], cols], blended[wn], blended[bn])
                grads = {wn: gw, bn: gb}
            else:
                grads, loss = step(blended, {k: v[:n] for k, v in fx_r.items()}, feats[run[:n], cols],
                                   labels[run[:n], cols], mask[run[:n], cols])
            with torch.no_grad():
                for k in w_r:
                    w_r[k][:n] = weight_step(w_r[k][:n], grads[k], dl_r[k][:n], eta)
                is_last = (steps_r[:n] - 1 == j).to(device)
                last[:n] = torch.where(is_last, loss.detach(), last[:n])
        for k in w:
            w[k][run] = w_r[k]
        still = []
        for pos, value in zip(running, last.tolist()):
            client = ctx.client_ids[active[pos]]
            if value != value or value in (float("inf"), float("-inf")):
                raise NonFiniteLossError(f"training loss became {value} "
                                         f"({ctx.where('ALA weight learning', active[pos])})")
            losses[pos].append(value)
            if bool(start_phase[pos]) and not ala.converged(losses[pos], client):
                still.append(pos)
        running = still
    return w, torch.tensor([len(v) for v in losses], dtype=torch.float)


@torch.no_grad()
def _linear_head_steps(h: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_head_step`` for n clients at once ([n, b, F] features, [n, C, F] weights)."""
    logits = torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))
    loss = -(torch.log_softmax(logits, dim=2) * targets).sum((1, 2))
    g = torch.softmax(logits, dim=2).mul_(scale).sub_(targets)
    return loss, torch.bmm(g.transpose(1, 2), h), g.sum(1)


@torch.no_grad()
def _features(ctx: "BatchedContext", fixed: Params, rows: torch.Tensor, lengths: list[int],
              prefix: int) -> torch.Tensor:
    """Inputs of the top units for every sampled row (the frozen lower units run once)."""
    x = ctx.fed.x[rows]
    if not prefix:
        return x
    if x.device.type == "cpu":
        # vmapped convolutions become grouped convolutions, slow on CPU: one large batch per client
        parts = [forward(ctx.model, {k: v[i] for k, v in fixed.items()}, x[i, :n], stop=prefix, train=True)
                 for i, n in enumerate(lengths)]
        out = parts[0].new_zeros((len(parts), x.shape[1], *parts[0].shape[1:]))
        for i, part in enumerate(parts):
            out[i, :len(part)] = part
        return out
    run = vmap(lambda p, xb: forward(ctx.model, p, xb, stop=prefix, train=True))
    per_step = max(1, ctx.train.eval_batch_size // max(len(rows), 1))
    parts = [run(fixed, x[:, i:i + per_step]) for i in range(0, x.shape[1], per_step)]
    return torch.cat(parts, dim=1)

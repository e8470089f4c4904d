"""Per-FedAvg (Fallah et al., NeurIPS 2020): a MAML-style global initialisation (spec §2.4).

Per local step, with batches B, B' (and B'' for the Hessian-free variant):

    w' = w - alpha * grad f(w; B)
    first order (default):  w <- w - beta * grad f(w'; B')
    hessian_free:           w <- w - beta * (I - alpha * hess f(w; B'')) grad f(w'; B')
                            (Hessian-vector product by double backward)

Batches: ``batch_pairs="independent"`` (default, the paper's reading) draws B and B' (size b each)
from two independent shuffles of the client's data ("train" and "outer" streams), n // b steps
per epoch; ``"split"`` is PFLlib's loader: one shuffle in batches of 2b, each split into halves
(B = first b samples, B' = the rest), n // (2b) steps per epoch. B'' always comes from its own
"hessian" stream (size b). Server: FedAvg.

Evaluated model: a copy of the received model after one SGD step (lr alpha) on one local training
batch ("adapt" stream), computed in ``after_receive`` so that it also follows ALA; the step is
discarded for training. With ``+ala`` ALA initialises the received model ("model").
"""

from __future__ import annotations

from typing import Iterator, Literal

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, check_finite
from ..functional.training import Batch
from .base import Algorithm, ClientContext, Payload, Settings, State, Upload, batch_order
from .registry import register


class PerFedAvgSettings(Settings):
    alpha: float | None = Field(None, gt=0, description="inner (personalisation) step size; None = the local "
                                "lr (FedALA App. G: alpha = local lr)")
    beta: float | None = Field(None, gt=0, description="outer (meta) step size; None = the local lr "
                               "(spec §2.4 [REF-CODE])")
    hessian_free: bool = Field(False, description="Hessian-free variant with a Hessian-vector product on a "
                               "third batch B'' (spec §2.4 [PAPER]); default first order (reference)")
    # spec §2.4: the paper draws B and B' independently; PFLlib splits one batch of size 2b in halves
    batch_pairs: Literal["independent", "split"] = Field(
        "independent", description="independent: B, B' from two independent shuffles (paper); split: "
        "one batch of 2b split in halves (PFLlib [REF-CODE]) (spec §2.4)")
    train_calls: int = Field(1, ge=1, description="local training passes per round; PFLlib's server calls "
                             "client.train() twice (spec §2.4 quirk: 2 reproduces it)")


def _trainable(units) -> list[str]:
    return [n for _, ms in units for n in ms]


def _loss_grads(ctx: ClientContext, params: Params, names: list[str], x: torch.Tensor, y: torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [params[k].detach().requires_grad_(True) for k in names]
    loss = F.cross_entropy(ctx.logits({**params, **dict(zip(names, leaves))}, x), y)
    return loss.detach(), list(torch.autograd.grad(loss, leaves))


def _hvp(ctx: ClientContext, params: Params, names: list[str], x: torch.Tensor, y: torch.Tensor,
         vector: list[torch.Tensor]) -> list[torch.Tensor]:
    """hess f(params; x, y) @ vector by double backward."""
    leaves = [params[k].detach().requires_grad_(True) for k in names]
    loss = F.cross_entropy(ctx.logits({**params, **dict(zip(names, leaves))}, x), y)
    grads = torch.autograd.grad(loss, leaves, create_graph=True)
    dot = sum((g * v.detach()).sum() for g, v in zip(grads, vector))
    return list(torch.autograd.grad(dot, leaves))


def _split_pairs(ctx: ClientContext, purpose: str, epochs: int) -> Iterator[tuple[Batch, Batch]]:
    """PFLlib's pairs: batches of 2b (drop_last; fewer samples: one batch of all), split in halves."""
    x, y = ctx.data.train_x, ctx.data.train_y
    b = ctx.train.batch_size
    for idx in batch_order(len(y), 2 * b, epochs, ctx.generator(purpose)):
        idx = idx.to(x.device)
        h = min(b, (len(idx) + 1) // 2)
        first, second = idx[:h], (idx[h:] if len(idx) > h else idx[:h])
        yield (x[first], y[first]), (x[second], y[second])


@register
class PerFedAvg(Algorithm):
    name = "perfedavg"
    settings_class = PerFedAvgSettings
    settings: PerFedAvgSettings
    supports_batching = False

    @property
    def alpha(self) -> float:
        return self.train.lr if self.settings.alpha is None else self.settings.alpha

    @property
    def beta(self) -> float:
        return self.train.lr if self.settings.beta is None else self.settings.beta

    def pairs(self, ctx: ClientContext, call: int) -> Iterator[tuple[Batch, Batch]]:
        suffix = "" if call == 0 else f"#{call}"
        epochs = self.train.local_epochs
        if self.settings.batch_pairs == "split":
            return _split_pairs(ctx, "train" + suffix, epochs)
        return zip(ctx.batches("train" + suffix, epochs), ctx.batches("outer" + suffix, epochs))

    def after_receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        """The evaluated model: one SGD step (lr alpha) from the initialised model on one batch."""
        model = state["model"]
        batch = next(iter(ctx.batches("adapt", 1)), None)
        if batch is None:
            return {**state, "eval": model}
        names = _trainable(self.units)
        work = {k: v.detach().clone() for k, v in model.items()}
        loss, grads = _loss_grads(ctx, work, names, *batch)
        check_finite(loss, ctx.where("one-step adaptation for evaluation"))
        with torch.no_grad():
            for k, g in zip(names, grads):
                work[k] = work[k] - self.alpha * g
        return {**state, "eval": work}

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        names = _trainable(self.units)
        w = {k: v.detach().clone() for k, v in state["model"].items()}
        alpha, beta = self.alpha, self.beta
        device = next(iter(w.values())).device
        loss_sum = torch.zeros((), device=device)  # f(w; B) + f(w'; B') of every step, for the NaN check
        inner_sum = torch.zeros((), device=device)
        steps = 0
        for call in range(self.settings.train_calls):
            suffix = "" if call == 0 else f"#{call}"
            hessian = ctx.batches("hessian" + suffix, self.train.local_epochs) if self.settings.hessian_free else None
            for (xb, yb), (xo, yo) in self.pairs(ctx, call):
                inner_loss, g = _loss_grads(ctx, w, names, xb, yb)
                with torch.no_grad():
                    w_prime = {**w, **{k: w[k] - alpha * gk for k, gk in zip(names, g)}}
                outer_loss, g_outer = _loss_grads(ctx, w_prime, names, xo, yo)
                if hessian is not None:
                    xh, yh = next(hessian)
                    hv = _hvp(ctx, w, names, xh, yh, g_outer)
                    g_outer = [go - alpha * h for go, h in zip(g_outer, hv)]
                with torch.no_grad():
                    for k, gk in zip(names, g_outer):
                        w[k] = w[k] - beta * gk
                loss_sum += inner_loss + outer_loss
                inner_sum += inner_loss
                steps += 1
        check_finite(loss_sum, ctx.where("local training"))
        new_state = {k: v for k, v in state.items() if k != "eval"}
        new_state["model"] = w
        return new_state, self.upload(w, ctx), {"train_loss": float(inner_sum) / max(steps, 1)}

    def eval_params(self, state: State) -> Params:
        return state["eval"]  # set by after_receive, which every local_init runs

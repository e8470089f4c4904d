"""PartialFed-Adaptive (Sun et al., NeurIPS 2021): learned layer-wise global/local loading
(spec §2.12, [RECON]: the paper gives no code; this is our reconstruction).

Client state: the local model theta and strategy logits S [U, 2] (U = number of units; column
0 = "load the global unit", column 1 = "keep the local unit"; init 0 = 50/50) and its position
in the batch cycle. Temperature tau_t = max(tau0 * decay^t, tau_min) for round t. The client
keeps its local model on receipt (the global stays in the payload) and runs its mini-batches
("train" stream, E epochs) in cycles of f_m model batches then f_s strategy batches (the cycle
continues across rounds unless ``continue_cycle=False``):

* model batch: hard Gumbel gates g_u = onehot(argmax(S_u + G_u)) (the forward value of the
  straight-through Gumbel-softmax; S is not updated on model batches); the working model
  becomes theta_u <- Theta_u (global) or theta_u (local) per unit, then one SGD step (local lr)
  on cross-entropy w.r.t. the working model, which stays the local model;
* strategy batch: relaxed gates g_u = softmax((S_u + G_u) / tau_t); forward the mixture
  g_u0 Theta_u + g_u1 theta_u with both models frozen; one SGD step (``strategy_lr``) on S only.

G is standard Gumbel noise, one [U, 2] draw per batch (model and strategy batches alike) from
the client's "gates" stream. Entries outside the units (batch-norm statistics) stay local.
Upload the working local model; server FedAvg.

Evaluated model: the client's current local model. With ``+ala`` ALA replaces the kept local
model by its blend of the received global and the old local ("model"); the gates then choose
per batch between the global and that ALA-initialised model.
"""

from __future__ import annotations

from typing import Sequence

import torch
from pydantic import Field, model_validator
from torch.nn import functional as F

from ..functional import Params, check_finite, clone
from ..models import Units
from .base import Algorithm, ClientContext, Payload, Settings, State, Upload
from .registry import register


class PartialFedSettings(Settings):
    # spec §2.12 [RECON]: every item below is our reconstruction of PartialFed-Adaptive
    tau0: float = Field(5.0, gt=0, description="initial Gumbel-softmax temperature (FedALA App. G: 5.0)")
    decay: float = Field(0.965, gt=0, le=1, description="per-round temperature decay (App. G: 0.965)")
    tau_min: float = Field(0.05, gt=0, description="temperature floor (spec §2.12 [UNCERTAIN])")
    model_batches: int = Field(8, ge=0, description="f_m, model batches per cycle (App. G: 8)")
    strategy_batches: int = Field(2, ge=0, description="f_s, strategy batches per cycle (App. G: 2)")
    strategy_lr: float | None = Field(None, gt=0, description="SGD lr of the strategy logits; None = local "
                                      "lr (spec §2.12 [UNCERTAIN])")
    continue_cycle: bool = Field(True, description="the f_m/f_s cycle continues across rounds (position kept "
                                 "in the client state), so clients with fewer than f_m + 1 batches per round "
                                 "still train S; False restarts it every round (spec §2.12 [RECON])")

    @model_validator(mode="after")
    def _some_batches(self) -> "PartialFedSettings":
        if self.model_batches + self.strategy_batches < 1:
            raise ValueError("model_batches + strategy_batches must be at least 1")
        return self


def temperature(tau0: float, decay: float, tau_min: float, round: int) -> float:
    """tau_t = max(tau0 * decay^t, tau_min)."""
    return max(tau0 * decay ** round, tau_min)


def gumbel_noise(generator: torch.Generator, shape: Sequence[int]) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)), u ~ U(0, 1) from ``generator`` (CPU)."""
    u = torch.rand(tuple(shape), generator=generator).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def select_units(global_: Params, local: Params, use_global: Sequence[bool], units: Units) -> Params:
    """Hard gates: unit u is copied from ``global_`` where ``use_global[u]``, else from ``local``.

    Entries that belong to no unit (buffers) are taken from ``local``.
    """
    out = dict(local)
    for flag, (_, names) in zip(use_global, units):
        if flag:
            out.update({k: global_[k] for k in names})
    return out


def mix_units(global_: Params, local: Params, gates: torch.Tensor, units: Units) -> Params:
    """Relaxed gates [U, 2]: unit u = gates[u, 0] * global + gates[u, 1] * local (buffers: local)."""
    out = dict(local)
    for u, (_, names) in enumerate(units):
        out.update({k: gates[u, 0] * global_[k] + gates[u, 1] * local[k] for k in names})
    return out


@register
class PartialFed(Algorithm):
    name = "partialfed"
    settings_class = PartialFedSettings
    settings: PartialFedSettings
    supports_batching = False

    def init_client(self, init_params: Params, client_id: int) -> State:
        device = next(iter(init_params.values())).device
        return {"model": clone(init_params), "strategy": torch.zeros(len(self.units), 2, device=device),
                "cycle_pos": torch.zeros((), dtype=torch.int64)}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        """No overwrite: the local model is kept; the global enters through the per-batch gates."""
        return state

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        cfg = self.settings
        names = [n for _, ms in self.units for n in ms]
        glob = {k: v.detach() for k, v in payload["global"].items()}
        local = {k: v.detach().clone() for k, v in state["model"].items()}
        strategy = state["strategy"].detach().clone()
        tau = temperature(cfg.tau0, cfg.decay, cfg.tau_min, ctx.round)
        lr, s_lr = self.train.lr, self.train.lr if cfg.strategy_lr is None else cfg.strategy_lr
        noise = ctx.generator("gates")
        cycle = cfg.model_batches + cfg.strategy_batches
        offset = int(state.get("cycle_pos", 0)) if cfg.continue_cycle else 0
        seen = 0
        device = strategy.device
        model_sum = torch.zeros((), device=device)
        strategy_sum = torch.zeros((), device=device)
        model_steps = strategy_steps = global_picks = 0
        for j, (x, y) in enumerate(ctx.batches("train", self.train.local_epochs)):
            g = gumbel_noise(noise, strategy.shape).to(device)
            seen += 1
            if (offset + j) % cycle < cfg.model_batches:
                use_global = ((strategy + g).argmax(dim=1) == 0).tolist()
                global_picks += sum(use_global)
                local = select_units(glob, local, use_global, self.units)
                leaves = [local[k].detach().requires_grad_(True) for k in names]
                loss = F.cross_entropy(ctx.logits({**local, **dict(zip(names, leaves))}, x), y)
                grads = torch.autograd.grad(loss, leaves)
                with torch.no_grad():
                    local = {**local, **{k: leaf - lr * gr for k, leaf, gr in zip(names, leaves, grads)}}
                model_sum += loss.detach()
                model_steps += 1
            else:
                logits = strategy.clone().requires_grad_(True)
                gates = torch.softmax((logits + g) / tau, dim=1)
                mixed = mix_units(glob, local, gates, self.units)
                loss = F.cross_entropy(ctx.logits(mixed, x), y)
                (grad,) = torch.autograd.grad(loss, [logits])
                strategy = strategy - s_lr * grad
                strategy_sum += loss.detach()
                strategy_steps += 1
        check_finite(model_sum, ctx.where("local training (model batches)"))
        check_finite(strategy_sum, ctx.where("strategy training (gate logits)"))
        metrics = {"train_loss": float(model_sum) / max(model_steps, 1),
                   "strategy_loss": float(strategy_sum) / max(strategy_steps, 1),
                   "tau": tau,
                   "global_share": float(torch.softmax(strategy, dim=1)[:, 0].mean()),
                   "global_picks": global_picks / max(model_steps * len(self.units), 1)}
        new_state = {**state, "model": local, "strategy": strategy,
                     "cycle_pos": torch.tensor((offset + seen) % cycle, dtype=torch.int64)}
        return new_state, self.upload(local, ctx), metrics

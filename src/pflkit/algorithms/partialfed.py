"""PartialFed-Adaptive (Sun et al., NeurIPS 2021): learned layer-wise global/local loading
(reconstructed: the paper gives no code; the method's page, docs/reference/methods/partialfed.md,
lists our choices).

Client state: the local model theta and strategy logits S [U, 2] (U = number of units; column
0 = "load the global unit", column 1 = "keep the local unit"; init 0 = 50/50) and its position
in the batch cycle. Temperature tau_t = max(tau0 * decay^t, tau_min) for round t. The client
keeps its local model on receipt (the global stays in the payload) and runs its mini-batches
("train" stream, E epochs) in cycles of f_m model batches then f_s strategy batches (the cycle
continues across rounds unless ``continue_cycle=False``).

``load = "round"`` (default; the paper's partial *initialisation*): after receipt (and after ALA
with ``+ala``) one hard Gumbel draw g_u = onehot(argmax(S_u + G_u)) ("init" stream) loads the
chosen units of the global model into the local model once: theta_hat = select(Theta, theta, g).
That is the evaluated model and the start of local training. Model batches are plain SGD steps on
the working model; strategy batches are the relaxed step below with the two candidates of this
round's initialisation (the received global Theta and the kept local theta, both frozen), i.e.
dL/dg_u0 = <grad_u L, Theta_u - theta_u> as in ALA, and S is used at the next initialisation.

``load = "batch"`` (the earlier reconstruction, kept for comparison): the gates are redrawn on
every model batch and the chosen units are re-copied from the *fixed* received global into the
working model before its SGD step, so every such copy discards the steps the unit took since the
last one (from S = 0 half the units each batch: about two surviving SGD steps per unit and round;
the upload is barely more than Theta^{t-1} and the local model a stale global plus a few local
steps). Per batch (the model batch as with load="batch"; with "round" it is a plain SGD step and
the strategy batch mixes Theta with the kept theta):

* model batch: hard Gumbel gates g_u = onehot(argmax(S_u + G_u)) (the forward value of the
  straight-through Gumbel-softmax; S is not updated on model batches); the working model
  becomes theta_u <- Theta_u (global) or theta_u (local) per unit, then one SGD step (local lr)
  on cross-entropy w.r.t. the working model, which stays the local model;
* strategy batch: relaxed gates g_u = softmax((S_u + G_u) / tau_t); forward the mixture
  g_u0 Theta_u + g_u1 theta_u with both models frozen; one SGD step (``strategy_lr``) on S only.

G is standard Gumbel noise, one [U, 2] draw per batch (model and strategy batches alike) from
the client's "gates" stream. Entries outside the units (batch-norm statistics) stay local.
Upload the working local model; server FedAvg.

Evaluated model: the client's local model after ``local_init`` (load="round": the partially
initialised one; "batch": the kept local model). With ``+ala`` ALA replaces the kept local model
by its blend of the received global and the old local ("model"); the gates then choose between
the global and that ALA-initialised model (once per round, or per batch with load="batch").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field, model_validator

from ..functional import Params, check_finite, clone
from ..functional.training import Batch, cross_entropy
from ..models import Units
from .base import Algorithm, ClientContext, Init, Payload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .context import PER_CLIENT, StepFn, TrainBatches
from .registry import register


class PartialFedSettings(Settings):
    # every item below is our reconstruction of PartialFed-Adaptive (the paper gives no code)
    load: Literal["round", "batch"] = Field(
        "round",
        description="when the gates load global units into the "
        "local model: once per round after receipt (partial initialisation) "
        "or again before every model batch from the fixed received global "
        "(discards the steps a reloaded unit took)",
    )
    tau0: float = Field(5.0, gt=0, description="initial Gumbel-softmax temperature (FedALA App. G: 5.0)")
    decay: float = Field(0.965, gt=0, le=1, description="per-round temperature decay (App. G: 0.965)")
    tau_min: float = Field(0.05, gt=0, description="temperature floor")
    model_batches: int = Field(8, ge=0, description="f_m, model batches per cycle (App. G: 8)")
    strategy_batches: int = Field(2, ge=0, description="f_s, strategy batches per cycle (App. G: 2)")
    strategy_lr: float | None = Field(None, gt=0, description="SGD lr of the strategy logits; None = local lr")
    continue_cycle: bool = Field(
        True,
        description="the f_m/f_s cycle continues across rounds (position kept "
        "in the client state), so clients with fewer than f_m + 1 batches per round "
        "still train S; False restarts it every round",
    )

    @model_validator(mode="after")
    def _some_batches(self) -> PartialFedSettings:
        if self.model_batches + self.strategy_batches < 1:
            raise ValueError("model_batches + strategy_batches must be at least 1")
        return self


def temperature(tau0: float, decay: float, tau_min: float, round: int) -> float:
    """tau_t = max(tau0 * decay^t, tau_min)."""
    return max(tau0 * decay**round, tau_min)


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


S, POS = "partialfed.strategy", "partialfed.cycle_pos"  # carried through the fit with the model
INIT_LOCAL = "init_local"  # load="round": the kept local model this round's initialisation chose from
# running sums carried through the fit for the round's metrics
MODEL_LOSS, MODEL_STEPS, STRATEGY_LOSS, STRATEGY_STEPS, PICKS = (
    "partialfed.model_loss",
    "partialfed.model_steps",
    "partialfed.strategy_loss",
    "partialfed.strategy_steps",
    "partialfed.global_picks",
)
COUNTERS = (MODEL_LOSS, MODEL_STEPS, STRATEGY_LOSS, STRATEGY_STEPS, PICKS)


@register
class PartialFed(Algorithm):
    name = "partialfed"
    settings_class = PartialFedSettings
    settings: PartialFedSettings
    needs = frozenset({PER_CLIENT})  # each batch branches on its position in the cycle and on a random draw

    def init_client(self, init_params: Params, client_id: int) -> State:
        device = next(iter(init_params.values())).device
        return {
            "model": clone(init_params),
            "strategy": torch.zeros(len(self.units), 2, device=device),
            "cycle_pos": torch.zeros((), dtype=torch.int64),
        }

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        """No overwrite: the local model is kept; the global enters through the gates."""
        return state, {}

    def after_receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        """load="round": the partial initialisation, one hard Gumbel draw per unit from S (runs after ALA)."""
        if self.settings.load != "round":
            return state, {}
        strategy = state["strategy"]
        g = gumbel_noise(ctx.generator("init"), strategy.shape).to(strategy.device)
        use_global = ((strategy + g).argmax(dim=1) == 0).tolist()
        local = state["model"]
        model = select_units(payload["global"], local, use_global, self.units)
        return {**state, "model": model, INIT_LOCAL: local}, {"global_picks": sum(use_global) / len(self.units)}

    def batch_step(self, ctx: ClientContext, tau: float, noise: torch.Generator) -> StepFn:
        """One model or strategy batch; branches in Python (per-client contexts)."""
        cfg = self.settings
        per_batch = cfg.load == "batch"
        lr, s_lr = ctx.train.lr, ctx.train.lr if cfg.strategy_lr is None else cfg.strategy_lr
        cycle, names, units, net = cfg.model_batches + cfg.strategy_batches, self.parameter_names, self.units, ctx.net

        def loss(params: Params, frozen: Params, batch: Batch) -> torch.Tensor:
            return cross_entropy(net({**frozen, **params}, batch.x), batch)

        def mixed_loss(logits: Params, frozen: Params, batch: Batch, glob: Params, local: Params) -> torch.Tensor:
            gates = torch.softmax((logits["s"] + frozen["gumbel"]) / tau, dim=1)
            return cross_entropy(net(mix_units(glob, local, gates, units), batch.x), batch)

        def step(value_and_grad, train, frozen, batch, aux):
            strategy, glob = train[S], aux["global"]
            g = gumbel_noise(noise, strategy.shape).to(strategy.device)
            local = {**{k: v for k, v in frozen.items()}, **{k: train[k] for k in names}}
            out = dict(train)
            if int(train[POS]) % cycle < cfg.model_batches:
                if per_batch:
                    use_global = ((strategy + g).argmax(dim=1) == 0).tolist()
                    local = select_units(glob, local, use_global, units)
                    out[PICKS] = train[PICKS] + sum(use_global)
                grads, value = value_and_grad(loss)({k: local[k] for k in names}, frozen, batch)
                out.update({k: local[k] - lr * grads[k] for k in names})
                out[MODEL_LOSS] = train[MODEL_LOSS] + value
                out[MODEL_STEPS] = train[MODEL_STEPS] + 1
            else:
                if not per_batch:  # the candidates of this round's initialisation
                    local = {**local, **aux["init_local"]}
                grads, value = value_and_grad(mixed_loss)({"s": strategy}, {**frozen, "gumbel": g}, batch, glob, local)
                out[S] = strategy - s_lr * grads["s"]
                out[STRATEGY_LOSS] = train[STRATEGY_LOSS] + value
                out[STRATEGY_STEPS] = train[STRATEGY_STEPS] + 1
            out[POS] = train[POS] + 1
            # Not fit's loss accounting: it has one mean and one NaN check per fit, and this fit runs two
            # kinds of step. Each kind sums its loss and steps in its own entries of the step's state
            # (trainable only in name: the step sets them), checked by kind after the fit; fit sees 0.
            return out, torch.zeros((), device=value.device)

        return step

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        cfg = self.settings
        tau = temperature(cfg.tau0, cfg.decay, cfg.tau_min, ctx.round)
        cycle = cfg.model_batches + cfg.strategy_batches
        offset = int(state.get("cycle_pos", 0)) if cfg.continue_cycle else 0
        device = state["strategy"].device
        counters = {k: torch.zeros((), device=device) for k in COUNTERS}
        params = {**state["model"], S: state["strategy"], POS: torch.tensor(offset), **counters}
        names = self.parameter_names
        glob = {k: v.detach() for k, v in payload["global"].items()}
        aux = {"global": glob}
        if cfg.load == "round":
            kept = state[INIT_LOCAL] if INIT_LOCAL in state else state["model"]  # without after_receive: the model
            aux["init_local"] = {k: kept[k].detach() for k in names}
        fit = ctx.fit(
            params,
            step=self.batch_step(ctx, tau, ctx.generator("gates")),
            trainable=[*names, S, POS, *COUNTERS],
            aux=aux,
            data=TrainBatches("train", self.train.local_epochs),
            stage="local training",
        )
        out = fit.params
        for name, total in (
            (MODEL_LOSS, "local training (model batches)"),
            (STRATEGY_LOSS, "strategy training (gate logits)"),
        ):
            check_finite(out[name], ctx.where(total))
        model_steps, strategy_steps = int(out[MODEL_STEPS]), int(out[STRATEGY_STEPS])
        strategy = out[S]
        metrics = {
            "train_loss": float(out[MODEL_LOSS]) / max(model_steps, 1),
            "strategy_loss": float(out[STRATEGY_LOSS]) / max(strategy_steps, 1),
            "tau": tau,
            "global_share": float(torch.softmax(strategy, dim=1)[:, 0].mean()),
        }
        if cfg.load == "batch":  # load="round" reports its picks from after_receive
            metrics["global_picks"] = float(out[PICKS]) / max(model_steps * len(self.units), 1)
        local = {k: out[k] for k in state["model"]}
        new_state = {
            **{k: v for k, v in state.items() if k != INIT_LOCAL},
            "model": local,
            "strategy": strategy,
            "cycle_pos": torch.tensor(int(out[POS]) % cycle, dtype=torch.int64),
        }
        return new_state, self.upload(local, ctx), metrics


PartialFed.card = MethodCard(
    full_name="PartialFed-Adaptive",
    paper=Paper(
        "PartialFed: Cross-Domain Personalized Federated Learning via Partial Initialization",
        "Sun et al.",
        2021,
        "NeurIPS",
    ),
    personalised=True,
    shares="Its model and its training-set size; the server averages them as FedAvg.",
    keeps="Its local model and the strategy logits S (per unit: load the global unit or keep the local one).",
    scored="the partially initialised model",
    client_round="At receipt, one hard Gumbel draw from the logits loads the chosen units of the global "
    "model into the local model (partial initialisation). Then cycles of 8 model batches of plain SGD "
    "and 2 strategy batches. The strategy batches train the logits on relaxed gates between the "
    "received global and the kept local model (τ₀ = 5, decay 0.965 per round). Upload the model.",
    references=(Reference("TsingZ0/PFLlib", "c79e660", ("clients/clientpartial.py",)),),
    no_reference="No usable reference exists. PFLlib's draft was deleted 7 minutes later (3c1024f). It "
    "cannot run: it reads attributes nothing defines, and its adaptive branch never switches on. Its "
    "design (one scalar strategy per tensor, soft blending) differs from pflkit's reconstruction of the "
    "paper throughout.",
    pinned=("tests/methods/test_partialfed.py::test_partialfed_model_batches_from_a_zero_strategy_as_pfllibs_draft",),
    choices=(
        Choice(
            "per-batch semantics",
            "the gates load global units once per round, at receipt, and the model batches are plain SGD "
            "from there. A per-batch reading redraws the gates and re-copies the chosen units from the "
            "received global before every model batch. Each copy discards the steps that unit took since "
            "the last one: from S = 0, half the units per batch, about two SGD steps per unit survive a "
            "round. Measured, seed 0: the digits demo's 60 rounds 78.17 % (per batch) against 96.94 % (per "
            "round), FedAvg 94.10 %. FedALA's Table 7 MNIST setting: 77.4 % after 17 rounds (per batch; "
            "FedAvg about 98 % by then) against 98.2 % after 3 (per round). The paper reports 99.67 %.",
            '`load = "batch"` (the per-batch reading)',
        ),
        Choice(
            "gate optimiser, τ_min",
            "plain SGD on the logits at the local lr, τ_min = 0.05",
            "`tau_min`, `strategy_lr`, `model_batches`, `strategy_batches`, `continue_cycle`",
        ),
    ),
    notes=("`train_loss` is the model batches' loss.",),
    reconstruction=True,
    ala_initialises="the local model (the gates then choose between the global and it)",
)

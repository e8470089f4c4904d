"""Adaptive Local Aggregation (ALA), the local-initialisation step of FedALA (AAAI 2023).

Instead of overwriting its local model with the downloaded global model, a client learns
element-wise weights W in [0, 1] on a random sample of its own training data (FedALA paper, Eq. 2-5
and Algorithm 1; the choices where the reference code differs: docs/explanations/design.md):

    Theta_hat = Theta_local + (Theta_global - Theta_local) * [1 (lower units); W (top p units)]
    W <- clip_[0,1](W - eta * dL/dTheta_hat * (Theta_global - Theta_local))     (paper Eq. 5/7)

Lower units are overwritten (the names the download carries); W persists per client
(initialised to ones); ALA is inactive while the downloaded model equals the local one (first
round); the first active round is the *start phase* (train W until the std of the last
``num_pre_loss`` epoch losses < ``threshold``, at most ``max_start_epochs`` epochs); later
rounds train W for one epoch.

The weight learning is one ``ctx.fit`` with W as the trained tensors, the s% sample as data and
the clip as the per-step transform: one client or many at once, whatever context the engine
gives. Batch-norm running statistics are no ALA weights; ALA's forward passes run in training
mode, like the reference (which trains a deep copy of the local model), on throwaway copies of
the statistics: the client's stored buffers are not changed by ALA.

``WithALA`` wraps any algorithm whose local initialisation overwrites a local copy with a
downloaded model (FedALA = FedAvg + ALA; "X + ALA" of FedALA Table 4). This module registers
the ``+ala`` name modifier and the ``fedala`` alias with a method registry (``pflkit.methods``
registers them with pflkit's).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import FunctionType
from typing import Any, Literal, TypedDict

import numpy as np
import torch
from pydantic import Field

from ..algorithms.base import Algorithm, Init, Payload, Settings, State
from ..algorithms.card import MethodCard, Paper, Reference
from ..algorithms.context import ClientContext, Metrics, SampleBatches, StepFn, TrainSettings
from ..algorithms.registry import Modifier, Registry
from ..functional import Params
from ..functional.training import Batch, Net, cross_entropy
from ..models import Units, buffer_names

log = logging.getLogger(__name__)


class ALASettings(Settings):
    """The ``[fedala]`` section: ALA hyperparameters, used by ``fedala`` and every ``X+ala``."""

    eta: float = Field(1.0, gt=0, description="learning rate of the ALA weights (App. G: 1.0)")
    sample_fraction: float = Field(
        0.8, gt=0, le=1, description="s, share of local training data sampled for ALA each round (App. G: s=80%)"
    )
    p: int = Field(1, ge=1, description="number of top units (layers/blocks) that ALA blends (App. G: 1)")
    threshold: float = Field(
        0.01,
        gt=0,
        description="start phase stops when the std of the last "
        "num_pre_loss epoch losses is below this (paper README: 0.01)",
    )
    num_pre_loss: int = Field(10, ge=2, description="window of the start-phase convergence test")
    max_start_epochs: int = Field(200, ge=1, description="hard cap on start-phase epochs (pflkit's)")
    sampling: Literal["random", "contiguous"] = Field(
        "random", description="s% sample: uniform subset (paper) or the reference code's contiguous slice"
    )
    cache_features: bool = Field(
        True,
        description="compute the frozen lower units' output on the sample once per round and "
        "iterate only the top p units (exact for models whose lower units are deterministic)",
    )
    closed_form_head: bool = Field(
        True,
        description="with p=1 and a linear head, use the closed-form cross-entropy gradient "
        "instead of autograd (same maths, less per-step overhead)",
    )
    start_round: int = Field(
        1, ge=1, description="ALA is off (plain overwrite, W kept) before this round (FedALA Fig. 4 starts it late)"
    )
    freeze_after_start: bool = Field(
        False, description="the paper's ablation: after its start phase a client reuses its W without further learning"
    )


class ALAState(TypedDict):
    """A client's ALA state: its weights W over the top units and whether it started."""

    weights: Params
    started: bool | torch.Tensor


def blend(local: Params, received: Params, weights: Params) -> Params:
    """Theta_local + (Theta_received - Theta_local) * W for the names in ``weights`` (Eq. 3)."""
    return {k: torch.addcmul(local[k], received[k] - local[k], w) for k, w in weights.items()}


def weight_update(weights: torch.Tensor, blended_grad: torch.Tensor, delta: torch.Tensor, eta: float) -> torch.Tensor:
    """W - eta * dL/dW with dL/dW = dL/dTheta_hat * (Theta_received - Theta_local) (paper Eq. 7);
    ``clip_weights`` then projects it to [0, 1] (Eq. 5)."""
    return torch.addcmul(weights, blended_grad, delta, value=-eta)


def clip_weights(weights: Params) -> None:
    """The projection of ALA's update: W <- clip_[0,1](W), in place."""
    for w in weights.values():
        w.clamp_(0.0, 1.0)


def linear_head_step(
    h: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of ``h @ weight.T + bias`` and its gradients, in closed form.

    ``target`` is one-hot(labels) / batch size; for a padded batch, ``scale`` is mask / real
    samples [b, 1] and ``target`` is zero on padding. dL/dlogits = softmax / B - target, so
    dL/dweight = (dL/dlogits)^T h and dL/dbias = its column sum: autograd's result (to float
    rounding) with a few tensor ops, since on CPU the per-op overhead dominates these steps.
    Every tensor may carry a leading client dimension (h [K, b, F], weight [K, C, F], ...).
    """
    if h.dim() == 2:
        logits = torch.addmm(bias, h, weight.t())
    else:
        logits = torch.baddbmm(bias.unsqueeze(-2), h, weight.transpose(-1, -2))
    loss = -(torch.log_softmax(logits, dim=-1) * target).sum((-2, -1))
    g = torch.softmax(logits, dim=-1)
    g = (g.div_(h.shape[-2]) if scale is None else g.mul(scale)).sub_(target)
    return loss, g.transpose(-1, -2) @ h, g.sum(-2)


def closed_form_step(eta: float, num_classes: int) -> StepFn:
    """ALA's step for p = 1 on a linear head, on cached features, in closed form; written for one
    client and for a leading client dimension alike (``fit(vectorized=True)``: batched contexts
    call it without vmap)."""

    def step(value_and_grad, weights, frozen, batch, aux):
        local, delta = aux["local"], aux["delta"]
        wn, bn = list(weights)
        scale = None if batch.mask is None else (batch.mask / batch.mask.sum(-1, keepdim=True))[..., None]
        target = (batch.y[..., None] == torch.arange(num_classes, device=batch.y.device)).to(batch.x.dtype)
        target = target.div_(batch.y.shape[-1]) if scale is None else target * scale
        weight, bias = (torch.addcmul(local[k], delta[k], weights[k]) for k in (wn, bn))
        loss, gw, gb = linear_head_step(batch.x, target, weight, bias, scale=scale)
        grads = {wn: gw, bn: gb}
        return {k: weight_update(weights[k], grads[k], delta[k], eta) for k in weights}, loss

    return step


def weight_statistics(weights: Params, units: Units, client_dims: int = 0) -> Metrics:
    """Per ALA unit, the mean and std of the client's learned W and the shares of its elements at
    0 and at 1 (``ala_w_mean.<unit>``, ``ala_w_std.<unit>``, ``ala_w_zero.<unit>``,
    ``ala_w_one.<unit>``); per client: tensors of the ``client_dims`` leading dimensions."""
    out: Metrics = {}
    for unit, members in units:
        present = [weights[k] for k in members if k in weights]
        if not present:
            continue
        w = torch.cat([t.flatten(client_dims) for t in present], dim=-1)
        out[f"ala_w_mean.{unit}"] = w.mean(-1)
        out[f"ala_w_std.{unit}"] = w.std(-1, unbiased=False)
        out[f"ala_w_zero.{unit}"] = (w == 0).to(w.dtype).mean(-1)
        out[f"ala_w_one.{unit}"] = (w == 1).to(w.dtype).mean(-1)
    return out


class AdaptiveLocalAggregation:
    """The ALA step for one model layout; stateless, all client state is passed in and out."""

    def __init__(self, settings: ALASettings, units: Units, train: TrainSettings) -> None:
        if settings.p > len(units):
            raise ValueError(
                f"fedala.p={settings.p} exceeds this model's {len(units)} units ({', '.join(u for u, _ in units)})"
            )
        self.settings = settings
        self.units = units
        self.train = train

    def init_state(self, downloaded: Params) -> ALAState:
        """Weights W initialised to ones over the top p of the downloaded units."""
        _, top = self.top_units(downloaded)
        # stored as a Python flag (a batched context stacks the flags, and every context splits them back)
        return ALAState(weights={k: torch.ones_like(downloaded[k]) for k in top}, started=False)

    def top_units(self, received: Params | list[str]) -> tuple[int, list[str]]:
        """(index of the lowest top unit, parameter names of the top p units among the units
        the payload carries); FedRep's payload carries the body only."""
        carried = [i for i, (_, ms) in enumerate(self.units) if all(m in received for m in ms)]
        if not carried:
            raise ValueError("ALA received no complete unit of the model")
        chosen = carried[-min(self.settings.p, len(carried)) :]
        return chosen[0], [n for i in chosen for n in self.units[i][1]]

    def top_names(self, received: Params | list[str]) -> list[str]:
        return self.top_units(received)[1]

    def closed_form(self, model: torch.nn.Module, prefix: int, top: list[str]) -> bool:
        """Whether the cached features feed only a linear head (p = 1): closed-form gradients."""
        return (
            self.settings.closed_form_head
            and prefix == len(self.units) - 1
            and getattr(model, "linear_head", False)
            and top == list(self.units[-1][1])
            and len(top) == 2
        )

    def prefix_stop(self, model: torch.nn.Module, lowest_top: int) -> int:
        """How many lower units can be computed once per round (0: no feature cache)."""
        if not self.settings.cache_features or not getattr(model, "prefix_is_deterministic", False):
            return 0
        # Only units below the lowest top unit, and only if none of them is blended.
        return lowest_top

    def converged(self, losses: list[float], client_id: int) -> bool:
        """The start-phase stopping rule, with the hard cap."""
        cfg = self.settings
        window = losses[-cfg.num_pre_loss :]
        if len(losses) > cfg.num_pre_loss and np.std(window) < cfg.threshold:
            return True
        if len(losses) >= cfg.max_start_epochs:
            if len(losses) <= cfg.num_pre_loss:
                log.warning(
                    "ALA start phase of client %d stopped at the cap of %d epochs, before its "
                    "convergence window of %d epochs filled",
                    client_id,
                    cfg.max_start_epochs,
                    cfg.num_pre_loss,
                )
            else:
                log.warning(
                    "ALA start phase of client %d stopped at the cap of %d epochs (loss std %.4g >= threshold %.4g)",
                    client_id,
                    cfg.max_start_epochs,
                    float(np.std(window)),
                    cfg.threshold,
                )
            return True
        return False

    def learning_step(self, net: Net, prefix: int, closed: bool, num_classes: int) -> StepFn:
        """One step on W: the loss of the blended top units on a batch of (cached) inputs."""
        eta = self.settings.eta
        if closed:
            return closed_form_step(eta, num_classes)

        def step(value_and_grad, weights, frozen, batch, aux):
            local, delta = aux["local"], aux["delta"]

            def blended_loss(blended: Params, frozen: Params, batch: Batch) -> torch.Tensor:
                return cross_entropy(net({**frozen, **blended}, batch.x, start=prefix), batch)

            blended = {k: torch.addcmul(local[k], delta[k], weights[k]) for k in weights}
            grads, loss = value_and_grad(blended_loss)(blended, frozen, batch)
            return {k: weight_update(weights[k], grads[k], delta[k], eta) for k in weights}, loss

        return step

    def __call__(
        self, received: Params, local: Params, state: ALAState, ctx: ClientContext
    ) -> tuple[Params, ALAState, Metrics]:
        """Return the initialised local model, the new ALA state and diagnostics."""
        lowest_top, top = self.top_units(received)
        if ctx.round < self.settings.start_round:  # not yet: the overwrite ALA replaces
            return (
                {k: received.get(k, v) for k, v in local.items()},
                state,
                {"ala_epochs": torch.zeros(ctx.client_shape, dtype=torch.long)},
            )
        active = ctx.differs(received, local)
        # per client, whether its start phase is over (the stored flag, or the batched context's stack of them)
        started = torch.as_tensor(state["started"], dtype=torch.bool, device=active.device)
        if self.settings.freeze_after_start:  # started clients keep their W: no learning, blend only
            active = active & ~started
        fixed = {**local, **{k: v for k, v in received.items() if k not in top}}
        # training-mode forwards update running statistics in place: give them throwaway copies
        scratch = {**fixed, **{k: fixed[k].detach().clone() for k in buffer_names(ctx.model) if k in fixed}}
        local_top = {k: local[k].detach() for k in top}
        delta = {k: received[k].detach() - local_top[k] for k in top}
        sample = ctx.sample("ala", self.settings.sample_fraction, self.settings.sampling)
        prefix = self.prefix_stop(ctx.model, lowest_top)
        if prefix:  # lower units are frozen: their output is constant this round
            sample = ctx.features(scratch, sample, stop=prefix)
        closed = self.closed_form(ctx.model, prefix, top)
        num_classes = local_top[top[-1]].shape[-1]
        start_phase = dict(zip(ctx.client_ids, (~started).reshape(-1).tolist()))

        def stop(losses: list[float], client_id: int) -> bool:
            return not start_phase[client_id] or self.converged(losses, client_id)

        frozen = {k: v for k, v in scratch.items() if k not in top}
        fit = ctx.fit(
            {**frozen, **state["weights"]},
            step=self.learning_step(ctx.net, prefix, closed, num_classes),
            vectorized=closed,
            trainable=top,
            aux={"local": local_top, "delta": delta},
            data=SampleBatches(sample),
            transform=clip_weights,
            until=stop,
            max_epochs=max(self.settings.max_start_epochs, 1),
            active=active,
            stage="ALA weight learning",
        )
        weights = {k: fit.params[k] for k in top}
        with torch.no_grad():
            initialised = {**fixed, **{k: torch.addcmul(local_top[k], delta[k], weights[k]) for k in top}}
        started = started | active
        metrics: Metrics = {
            "ala_epochs": fit.epochs,
            "ala_loss": fit.last_loss,
            **weight_statistics(weights, self.units, len(ctx.client_shape)),
        }
        if fit.history is not None:  # per-epoch losses (the start phase's curve, paper Fig. 3)
            metrics["ala_epoch_losses"] = fit.history
        return {k: initialised[k] for k in local}, ALAState(weights=weights, started=started), metrics


class WithALA(Algorithm):
    """``base`` with its local initialisation replaced by ALA on its configured target.

    Every hook of ``Algorithm`` that ALA does not change is the base's (delegated below, so a
    hook added to ``Algorithm`` or overridden by an outside method is honoured too); ALA changes
    ``receive`` (the overwrite it replaces; ``local_init`` stays ``receive`` then the base's
    ``after_receive``), ``init_client`` (W joins the state), and adds to ``round_metrics`` and
    ``summary_metrics``."""

    trains_on_receive = True
    #: the hooks ALA changes; every other public hook is the base's
    OWN_HOOKS = frozenset(
        {"local_init", "receive", "init_client", "newcomer_state", "round_metrics", "summary_metrics"}
    )

    def __init__(self, base: Algorithm, ala: AdaptiveLocalAggregation, display_name: str) -> None:
        super().__init__(base.settings, base.train, base.units)
        self.base = base
        self.ala = ala
        for attribute in CLASS_SETTINGS:  # what engines and the config read off the method
            setattr(self, attribute, getattr(base, attribute))
        self.name = display_name  # type: ignore[misc]  # per instance: the wrapped method's name (a ClassVar)
        if type(base).local_init is not Algorithm.local_init:
            raise ValueError(
                f"{base.name} overrides local_init, so ALA has no receive step to replace; override "
                "receive and after_receive instead"
            )
        target = base.ala_target
        if target not in base.ala_targets:
            raise ValueError(f"{base.name} offers ALA targets {sorted(base.ala_targets)}, not {target!r}")
        self.payload_key, self.state_key = base.ala_targets[target]

    def round_metrics(self, client_metrics: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
        """The base's, the most epochs a client's weight learning ran, and in the start phase each
        client's weight-learning loss per epoch (paper Fig. 3)."""
        out = self.base.round_metrics(client_metrics)
        epochs = [float(m["ala_epochs"]) for m in client_metrics.values() if "ala_epochs" in m]
        if epochs:
            out["ala_epochs_max"] = max(epochs)
        starts = {
            str(c): [float(v) for v in m["ala_epoch_losses"]]
            for c, m in client_metrics.items()
            if len(m.get("ala_epoch_losses") or []) > 1
        }
        if starts:
            out["ala_start_losses"] = starts
        return out

    def summary_metrics(self, init_params: Params) -> dict[str, Any]:
        return {**self.base.summary_metrics(init_params), "ala_weights": self.num_ala_weights(init_params)}

    def num_ala_weights(self, init_params: Params) -> int:
        """How many element-wise weights ALA learns per client (FedALA Tables 1 and 6, "Param.")."""
        downloaded = {k: init_params[k] for k in self.base.downloaded_names(list(init_params))}
        return sum(w.numel() for w in self.ala.init_state(downloaded)["weights"].values())

    def init_client(self, init_params: Params, client_id: int) -> State:
        downloaded = {k: init_params[k] for k in self.base.downloaded_names(list(init_params))}
        return {**self.base.init_client(init_params, client_id), "ala": self.ala.init_state(downloaded)}

    def newcomer_state(self, init_params: Params, payload: Payload, client_id: int) -> State:
        """The base's newcomer with ALA's fresh weights: ALA then starts from the initial model."""
        downloaded = {k: init_params[k] for k in self.base.downloaded_names(list(init_params))}
        return {**self.base.newcomer_state(init_params, payload, client_id), "ala": self.ala.init_state(downloaded)}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        old_local = state[self.state_key]
        new_state, metrics = self.base.receive(payload, state, ctx)
        initialised, ala_state, ala_metrics = self.ala(payload[self.payload_key], old_local, state["ala"], ctx)
        return {**new_state, self.state_key: initialised, "ala": ala_state}, {**metrics, **ala_metrics}


#: class attributes of a method that a wrapper takes from its base (``name`` it sets itself)
CLASS_SETTINGS = (
    "settings_class",
    "section",
    "ala_targets",
    "default_ala_target",
    "needs",
    "requires_full_participation",
    "has_global_model",
    "personal_part",
    "tta_base",
    "metric_reductions",
    "newcomer_refusal",
)


def algorithm_hooks() -> list[str]:
    """The public methods and properties of ``Algorithm``: the hooks a method may override."""
    return [
        name
        for name, value in vars(Algorithm).items()
        if not name.startswith("_") and isinstance(value, (FunctionType, property, staticmethod))
    ]


def _delegate(hook: str) -> Any:
    if isinstance(vars(Algorithm)[hook], property):
        return property(lambda self: getattr(self.base, hook), doc=f"The base method's ``{hook}``.")

    def delegated(self: WithALA, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.base, hook)(*args, **kwargs)

    delegated.__name__ = delegated.__qualname__ = hook
    delegated.__doc__ = f"The base method's ``{hook}``."
    return delegated


for _hook in algorithm_hooks():
    if _hook not in WithALA.OWN_HOOKS:
        setattr(WithALA, _hook, _delegate(_hook))


def _with_ala(base: Algorithm, settings: Settings, name: str) -> Algorithm:
    assert isinstance(settings, ALASettings)
    return WithALA(base, AdaptiveLocalAggregation(settings, base.units, base.train), display_name=name)


#: FedALA: what ``+ala`` does, for the ``fedala`` page
ALA_CARD = MethodCard(
    full_name="FedALA",
    paper=Paper(
        "FedALA: Adaptive Local Aggregation for Personalized Federated Learning",
        "Zhang et al.",
        2023,
        "AAAI",
        "https://arxiv.org/abs/2212.01197",
    ),
    personalised=True,
    shares="What the base method uploads (`fedala`: FedAvg's whole model).",
    keeps="The local model and ALA's element-wise weights W.",
    scored="the ALA-initialised model",
    client_round="Instead of overwriting the local model with the download, learn element-wise weights W in "
    "[0, 1] on a random sample of the client's training data (s = 80 %). The lower units take the global "
    "model; the top p units become Θ_local + (Θ_global − Θ_local)·W. The first active round trains W until "
    "the loss settles (the start phase); later rounds train W for one epoch. Then the base method trains "
    "(`fedala` = `fedavg+ala`: FedAvg).",
    references=(Reference("TsingZ0/FedALA", "a7a9b21", ("system/utils/ALA.py",)),),
    tests=(
        "tests/methods/test_fedala.py::test_fedala_matches_ala_py_first_round_idle_then_start_phase_then_one_epoch",
        "tests/personalize/test_ala.py::test_matches_transcription_of_reference_loop",
    ),
    differences=(
        "The FedALA-era commit 7939ca7 differs from a7a9b21 only in the threshold default and in `drop_last` "
        "on the sample.",
        "The first test runs both fast paths and plain autograd.",
        "ALA's random sample is compared with ALA.py's contiguous slice only with `sampling = \"contiguous\"`; "
        "`tests/personalize/test_ala.py` gives its transcription pflkit's own sample.",
        "Choices between the paper and the reference code (docs/explanations/design.md): p counts units "
        '(`reference_layer_idx`), a random sample by default (`sampling = "contiguous"`), threshold 0.01, a '
        "200-epoch cap, exact-equality deactivation, and only participants run ALA.",
    ),
    notes=(
        "`X+ala` applies ALA to any method that downloads a single model; each method's page says what ALA "
        "initialises there.",
    ),
)

ALA_SECTION = "fedala"
#: ``<method>+ala``: any method that offers an ALA target, with ALA's settings in ``[fedala]``
ALA_MODIFIER = Modifier(
    suffix="+ala",
    section=ALA_SECTION,
    settings_class=ALASettings,
    applies=lambda cls: bool(cls.ala_targets),
    wrap=_with_ala,
    refusal="{base} downloads no single model that ALA could initialise; {name!r} is undefined",
    reason=lambda cls: cls.ala_refusal,
    card=ALA_CARD,
)


def register(registry: Registry) -> None:
    """Add the ``+ala`` modifier and the ``fedala`` alias (= ``fedavg+ala``) to ``registry``
    (``pflkit.methods`` does, for pflkit's registry; idempotent)."""
    registry.register_modifier(ALA_MODIFIER, aliases={"fedala": "fedavg+ala"})

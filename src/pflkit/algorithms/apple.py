"""APPLE (Luo & Wu, IJCAI 2022): personalised models as learned mixtures of all clients' core
models.

Client i keeps its core model w_i^c and a directed-relationship vector p_i (initialised to the
clients' data shares p^0). Each round it downloads every other client's core and, on every
mini-batch, minimises CE(w_i^p) + lambda(r) mu ||p_i - p^0||^2 with w_i^p = sum_j p_ij w_j^c,
updating only its own core (lr ``core_lr``, default the local lr) and p_i (lr ``dr_lr``); the
other cores are frozen.
lambda(r) anneals to 0 at round L*R (cos or exp schedule). It uploads its core; p_i stays local.
Every client must take part in every round. Evaluated model: w_i^p. No ALA: several models
are downloaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, scale
from ..functional.training import Batch, LossFn, Net, NonFiniteLossError, cross_entropy
from .base import Algorithm, ClientContext, ClientSummary, Init, Payload, SentUpload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .registry import register


class AppleSettings(Settings):
    dr_lr: float = Field(0.01, gt=0, description="eta_2, learning rate of the DR vector (App. G: 0.01)")
    mu: float = Field(0.1, ge=0, description="mu, weight of the proximal term on p (App. G: 0.1)")
    L: float = Field(0.2, ge=0, le=1, description="share of the rounds during which lambda(r) > 0 (App. G: 0.2)")
    scheduler: Literal["cos", "exp"] = Field("cos", description="lambda(r) schedule (App. G: cos)")
    core_lr: float | None = Field(
        None,
        gt=0,
        description="eta_1, core learning rate; None = the local lr. "
        "PFLlib's lr x N diverges with the true gradient of p (docs/reference/methods/apple.md)",
    )
    p_gradient: Literal["true", "layer_mean"] = Field(
        "true",
        description="the gradient p_i steps on: the true one, sum over every parameter of grad * w_j (the "
        "authors' autograd), or PFLlib's, the mean over the parameter tensors of each tensor's mean of "
        "grad * w_j (the step FedALA's Table 7 ran)",
    )


def loss_scale(r: int, total_rounds: int, L: float, scheduler: str) -> float:
    """lambda(r): 1/2 (1 + cos(pi r / (L R))) or 0.001^(r / (L R)) for r < L R, else 0."""
    horizon = L * total_rounds
    if r >= horizon:
        return 0.0
    if scheduler == "cos":
        return 0.5 * (1.0 + math.cos(math.pi * r / horizon))
    return 0.001 ** (r / horizon)


P = "apple.p"  # the DR vector among the tensors a fit trains
P_SUM = "p_sum"  # a client's sum_j p_ij after its training (1 at the start: the data shares)
LOWER_DR_LR = "lower apple.dr_lr (the authors' code uses 0.001) or the learning rate (lr)"


def weight_sums(p: torch.Tensor, ctx: ClientContext) -> str:
    """Where the clients' mixture weights stood when their training diverged, and why they grow."""
    sums = p.double().sum(-1).reshape(-1)
    worst = int(sums.argmax())
    return (
        f"apple: client {ctx.client_ids[worst]}'s mixture weights p_i summed to {float(sums[worst]):.3g} at the "
        f"start of round {ctx.round} (they start at 1, the data shares; '{P_SUM}' in the records is each "
        f"round's mean over the clients). Each gradient ∂L/∂p_ij = ⟨∇L(w_i^p), w_j⟩ sums over every "
        f"parameter, so the weights can grow together and scale the mixed model up: {LOWER_DR_LR}"
    )


def stacked_cores(cores: list[Params], lead: int) -> Params:
    """The downloaded cores stacked per parameter along a new dimension after the ``lead`` client
    dimensions ([N, ...], batched [K, N, ...]): the mixture of a step is then one contraction."""
    return {k: torch.stack([core[k] for core in cores], dim=lead) for k in cores[0]}


def mixture(
    p: torch.Tensor,
    stacked: Params,
    own: Params,
    own_onehot: torch.Tensor,
    grad_scale: Mapping[str, float] | None = None,
) -> Params:
    """w^p = sum_j p_j w_j^c with the client's own core in its own slot (p [N], or [K, N]; ``stacked``
    from :func:`stacked_cores`): the other cores are frozen, so each parameter is one tensordot of the
    weights with the stack (gradient of p: the same contraction with the gradient) plus the own term.
    ``grad_scale``: per parameter, a factor on what its term adds to p's gradient (the values stay p's)."""
    others = p * (1 - own_onehot)
    self_weight = (p * own_onehot).sum(-1)
    out = {}
    for k, value in own.items():
        weights, own_weight = others, self_weight
        if grad_scale is not None and k in grad_scale:
            scaled = p.detach() + grad_scale[k] * (p - p.detach())  # p itself, its gradient times the factor
            weights, own_weight = scaled * (1 - own_onehot), (scaled * own_onehot).sum(-1)
        cores = stacked[k]
        lead = weights.dim() - 1
        flat = cores.reshape(*cores.shape[: lead + 1], -1)  # [..., N, numel]
        mixed = torch.matmul(weights.unsqueeze(-2), flat).squeeze(-2).reshape(value.shape)
        out[k] = mixed + scale(own_weight, value)
    return out


def layer_mean_scales(params: Params, names: list[str], lead: int) -> dict[str, float]:
    """PFLlib's gradient of p as factors on the true one: 1 / (number of tensors x a tensor's size)."""
    return {k: 1.0 / (len(names) * math.prod(params[k].shape[lead:])) for k in names}


def apple_loss(scale_p: float, grad_scale: Mapping[str, float] | None = None) -> LossFn:
    """CE of the personalised mixture + lambda(r) mu ||p - p0||^2."""

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        p = params[P]
        own = {k: v for k, v in params.items() if k != P}
        value = cross_entropy(net(mixture(p, aux["stacked"], own, aux["own"], grad_scale), batch.x), batch)
        return value + scale_p * torch.sum((p - aux["p0"]) ** 2) if scale_p else value

    return loss


@register
class Apple(Algorithm):
    name = "apple"
    settings_class = AppleSettings
    settings: AppleSettings
    ala_targets = {}
    requires_full_participation = True
    newcomer_refusal = "apple mixes the core models with each client's own learned weights and core model"

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        sizes = torch.zeros(max(c.client_id for c in clients) + 1)
        for c in clients:
            sizes[c.client_id] = c.num_train
        device = next(iter(server["global"].values())).device
        return {
            **server,
            "models": {c.client_id: server["global"] for c in clients},
            "p0": (sizes / sizes.sum()).to(device),
        }

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        return {"cores": [server["models"][j] for j in range(len(server["p0"]))], "p0": server["p0"]}

    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": dict(init_params), "p": torch.empty(0), "personal": dict(init_params)}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        p = state["p"] if state["p"].numel() else payload["p0"].clone()
        return {**state, "p": p}, {}

    def own_onehot(self, payload: Payload, ctx: ClientContext) -> torch.Tensor:
        n = payload["p0"].shape[-1]
        index = torch.as_tensor(ctx.client_index, device=payload["p0"].device)
        return F.one_hot(index, n).to(payload["p0"].dtype)

    def after_receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        with torch.no_grad():
            stacked = stacked_cores(payload["cores"], len(ctx.client_shape))
            personal = mixture(state["p"], stacked, state["model"], self.own_onehot(payload, ctx))
        return {**state, "personal": personal}, {}

    def eval_params(self, state: State) -> Params:
        return state["personal"]

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        return self.keep_latest_models(server, uploads)

    def schedule_rounds(self) -> int:
        """lambda(r) > 0 until round L*R: the plateau rule waits for the first round without it."""
        return math.ceil(self.settings.L * self.train.rounds)

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        cfg = self.settings
        core_lr = cfg.core_lr if cfg.core_lr is not None else ctx.train.lr
        scale_p = loss_scale(ctx.round, self.train.rounds, cfg.L, cfg.scheduler) * cfg.mu
        aux = {
            "stacked": stacked_cores(payload["cores"], len(ctx.client_shape)),
            "p0": payload["p0"],
            "own": self.own_onehot(payload, ctx),
        }
        names = self.parameter_names
        lead = len(ctx.client_shape)
        grad_scale = layer_mean_scales(state["model"], names, lead) if cfg.p_gradient == "layer_mean" else None
        try:
            fit = self.train_model(
                {**state["model"], P: state["p"]},
                ctx,
                apple_loss(scale_p, grad_scale),
                aux=aux,
                trainable=[*names, P],
                # the ignore: a per-parameter rate, as **{P: ...} since P is no identifier
                optimizer=self.train.optimizer(core_lr, **{P: cfg.dr_lr}),  # type: ignore[arg-type]
            )
        except NonFiniteLossError as error:
            raise NonFiniteLossError(f"{error}. {weight_sums(state['p'], ctx)}") from error
        core = {k: fit.params[k] for k in state["model"]}
        new_state = {**state, "model": core, "p": fit.params[P]}
        return new_state, self.upload(core, ctx), {"train_loss": fit.loss, P_SUM: fit.params[P].sum(-1)}

    def round_metrics(self, client_metrics: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
        """The largest sum of a client's mixture weights (``p_sum_max``) and its client."""
        sums = {c: float(m[P_SUM]) for c, m in client_metrics.items() if P_SUM in m}
        if not sums:
            return {}
        worst = max(sums, key=lambda c: sums[c])
        return {f"{P_SUM}_max": sums[worst], f"{P_SUM}_max_client": worst}


Apple.card = MethodCard(
    full_name="APPLE",
    paper=Paper(
        "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated Learning",
        "Luo & Wu",
        2022,
        "IJCAI",
        "https://arxiv.org/abs/2110.08394",
    ),
    personalised=True,
    shares="Its core model; every client downloads every core.",
    keeps="Its directed-relationship vector p_i.",
    scored="the mixture Σ_j p_ij w_j",
    scored_detail="The mixture formed at receipt.",
    client_round="Download every client's core; the personalised model is Σ_j p_ij w_j. Per batch, update "
    "the own core (η₁ = lr) and p_i (η₂ = 0.01, proximal μ = 0.1 toward p⁰, a cos schedule over L = 0.2 "
    "of the rounds). Upload the core.",
    references=(
        Reference("TsingZ0/PFLlib", "ffb17a9", ("clients/clientapple.py", "servers/serverapple.py")),
        Reference(
            "ljaiverson/pFL-APPLE",
            "8078196",
            (
                "train_APPLE.py (train_one_round)",
                "utils/models.py (ClientNet)",
                "utils/losses.py (reg_loss, get_reg_coef)",
                "utils/apple.py (init_pss)",
            ),
        ),
    ),
    tests=(
        "tests/methods/test_apple.py::test_apple_client_round_matches_pfllib_with_core_lr_n_times_lr_and_the_true_gradient_of_p",
        "tests/methods/test_apple.py::test_apple_round_with_the_proximal_term_matches_the_authors_client_under_momentum",
        "tests/methods/test_apple.py::test_apple_layer_mean_gradient_of_p_is_pfllibs",
    ),
    pinned=(
        "tests/methods/test_apple.py::test_apple_first_p_is_uniform_as_in_pfllib",
        "tests/methods/test_apple.py::test_apple_upload_is_pfllibs_model_c",
        "tests/methods/test_apple.py::test_apple_proximal_step_on_p_is_pfllibs",
        "tests/methods/test_apple.py::test_apple_lambda_schedule_is_pfllibs",
    ),
    differences=(
        "PFLlib (ffb17a9, the first commit with APPLE) is compared at `core_lr` = N·lr and μ = 0, with the "
        'true gradient of p and, under `p_gradient = "layer_mean"`, with its own. The authors\' client is '
        "compared at the default core lr, with μ = 1 in a round with λ > 0 and momentum 0.9.",
        "PFLlib's gradient of p_ii reads the own core after that batch's step; pflkit's (`layer_mean` too) "
        "the core the batch ran on. On the test's clients that changes p's small move by about 40%.",
        "PFLlib starts p at 1/N; pflkit at the data shares p⁰.",
        "PFLlib uploads the mixture formed at its last batch instead of the trained core. It also shares "
        "cores in place within a round (undone upstream in 7101091).",
        "PFLlib steps λμ(p − p⁰), where pflkit's λμ‖p − p⁰‖² steps twice that.",
        "PFLlib's λ schedule lags pflkit's by two rounds.",
        "The authors' code does as pflkit in three of these: p starts at p⁰, the trained core is uploaded, "
        "and the term is λμ‖p − p⁰‖². It also takes the true gradient of p (autograd through `ClientNet`) "
        "and steps the core at its own lr (`lr_net`, not × N).",
        "The authors' λ schedule lags pflkit's by one round and counts ⌊L·R⌋ rounds.",
        "The authors' SGD has momentum 0.9, fixed in the code, on the cores and on p. pflkit uses the "
        "run's `momentum` (default 0) on both.",
        "The authors score the mixture after the round's training; pflkit the one formed at receipt.",
        "The authors' defaults (lr 0.01, p lr 0.001, L = 0.1, exponential schedule) are not FedALA Appendix G's.",
    ),
    choices=(
        Choice(
            "core learning rate",
            "plain SGD at the local lr. PFLlib's lr × N diverged on MNIST (lr 0.1: NaN in round 1 for small "
            "clients), because with the true gradient of p (not PFLlib's mean of element-wise products) "
            "p_ii grows from n_i/n within a round. The authors' code also steps the cores at a plain rate.",
            "`core_lr` (e.g. `apple.core_lr = 2.0` for lr × N at lr 0.1)",
        ),
        Choice(
            "the gradient p steps on",
            "the true one, Σ over every parameter of ∇L ⊙ w_j (the authors' autograd)",
            '`p_gradient = "layer_mean"`: PFLlib\'s mean over the tensors of mean(∇L ⊙ w_j), the step '
            "FedALA's Table 7 ran; p then barely moves from p⁰",
        ),
        Choice("λ schedule", "cos", '`scheduler = "exp"`'),
    ),
    notes=(
        "λ(r) runs over the first L·R rounds of `rounds` (R). The plateau rule (`plateau_evaluations`) "
        "judges an APPLE run only from the evaluation of round ⌈L·R⌉ on. A plateau while the proximal term "
        "still pulls p toward p⁰ is no convergence. On FedALA's MNIST Table 7 setting (R = 200 as a cap), "
        "the rule had stopped APPLE at round 34 of its 40-round schedule.",
        "`train_loss` includes the proximal term.",
        "Each round's records carry `p_sum`, the clients' mean of Σ_j p_ij (1 at the start, the data "
        "shares), and `p_sum_max` with its client (`p_sum_max_client`). The true gradient ∂L/∂p_ij = "
        "⟨∇L(w_i^p), w_j⟩ sums over every parameter, so the weights can grow together and scale the mixed "
        "model up. A client whose training diverges is named with its sum; `dr_lr` is the setting to lower.",
    ),
)

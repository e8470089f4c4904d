"""FedCP (Zhang et al., KDD 2023): a conditional policy network splits each sample's feature into a
global part for the global head and a personalised part for a personal head.

Between the body and the head (``pflkit.models.between``) sits the CPN: from h * normalise(v),
v the client's context vector, a linear layer (d -> 2d), layer norm and ReLU give [2, d] scores
per sample; a softmax over the two rows (with Gumbel noise in training, temperature τ) gives
the personal and global masks s_p + s_g = 1, and logits = head_p(h * s_p) + head_g(h * s_g). The
client trains the body, the CPN and its personal head head_p on CE + λ MMD(h, h_0), h_0 the
features of the received (frozen) body, MMD with the authors' RBF kernels; the global head head_g
stays frozen. It uploads the body, the CPN and 0.5 head_p + 0.5 head_g; the server averages all
three (sample-weighted) into the next body, CPN and head_g. v is the column sum of head_p's weight
after training (a random vector before the client first trains). The model's own head entries
hold head_g; head_p, v and the CPN are entries ``between.fedcp.*``.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, clone, torch_generator
from ..functional.training import Batch, CarryLossFn, Net, cross_entropy
from ..models.between import Between, Head, register_between, without_between
from .base import ClientContext, Init, Payload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .context import TrainBatches
from .registry import register
from .routed import RoutedMethod

BASE = "fedcp.base."  # the received body, frozen, among the tensors a fit reads (h_0)
KEY = "fedcp.noise_key"  # the counter of the training noise, carried from step to step
KERNEL_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # the authors' RBF kernels


class FedCPSettings(Settings):
    lamda: float = Field(5.0, ge=0, description="λ, the weight of the MMD term (the authors' script: 5)")
    tau: float = Field(
        1.0,
        gt=0,
        description="τ, the temperature of the CPN's softmax, in training (with Gumbel noise) and in "
        "scoring (the authors': 1)",
    )
    gumbel: bool = Field(True, description="Gumbel noise in the CPN's training forward (the authors'); false: none")


class ConditionalPolicy(Between):
    """FedCP's CPN and personal head: shared ``cpn.*``, personal ``head.*`` and ``context``."""

    kind = "fedcp"
    shared = frozenset({"cpn.weight", "cpn.bias", "norm.weight", "norm.bias"})

    def masks(self, params: Any, h: torch.Tensor, tau: float, noise: torch.Tensor | None) -> torch.Tensor:
        """[b, 2, d]: the personal (row 0) and global (row 1) masks of features ``h`` [b, d]."""
        n = self.name
        gate_in = h * F.normalize(params[n("context")], dim=-1)
        z = F.linear(gate_in, params[n("cpn.weight")], params[n("cpn.bias")])
        z = F.relu(F.layer_norm(z, z.shape[-1:], params[n("norm.weight")], params[n("norm.bias")]))
        z = z.reshape(h.shape[0], 2, -1)
        return torch.softmax((z if noise is None else z + noise) / tau, dim=1)

    def logits(self, params: Any, h: torch.Tensor, head: Head, tau: float, noise: torch.Tensor | None) -> torch.Tensor:
        s = self.masks(params, h, tau, noise)
        personal = {k[len(self.prefix) + 5 :]: v for k, v in params.items() if k.startswith(self.name("head."))}
        return head({**params, **personal}, h * s[:, 0]) + head(params, h * s[:, 1])

    def route(self, params: Any, h: torch.Tensor, head: Head) -> torch.Tensor:
        """The scored forward: no noise, at the τ the client trains with (its state's ``tau``; the
        authors use one τ for both); 1 for a state without one."""
        tau = params.get(self.name("tau"))
        return self.logits(params, h, head, 1.0 if tau is None else tau, None)


CPN = register_between(ConditionalPolicy())


# ---- counter-based Gumbel noise: a pure function of a carried key (the same on every engine) ----
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x < 2^32 without int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def open_unit(bits: torch.Tensor) -> torch.Tensor:
    """Uniforms strictly inside (0, 1) in float32 from 23-bit integers: (bits + 0.5) / 2²³. (With
    24 bits the largest, 1 − 2⁻²⁵, rounds to 1.0 in float32, and its Gumbel noise is infinite.)"""
    return (bits.to(torch.float32) + 0.5) / 2**23


def gumbel_noise(key: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise of ``shape`` in ``like``'s dtype, a pure function of the integer ``key``."""
    count = 1
    for s in shape:
        count *= s
    counter = torch.arange(count, device=like.device, dtype=torch.int64)
    bits = _mix32((counter + _mix32(key.to(torch.int64) & _M32)) & _M32) >> 9
    return (-torch.log(-torch.log(open_unit(bits)))).to(like.dtype).reshape(shape)


def mmd(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The authors' empirical MMD of ``x`` and ``y`` [b, d] under their sum of RBF kernels
    exp(-0.5 ||a - b||^2 / w), w in (10, 15, 20, 50); ``mask`` weighs the real samples."""
    xx, yy, xy = x @ x.t(), y @ y.t(), x @ y.t()
    rx, ry = xx.diagonal(), yy.diagonal()
    dxx, dyy = rx[:, None] + rx[None, :] - 2 * xx, ry[:, None] + ry[None, :] - 2 * yy
    dxy = rx[:, None] + ry[None, :] - 2 * xy
    total = sum(
        torch.exp(-0.5 * dxx / w) + torch.exp(-0.5 * dyy / w) - 2 * torch.exp(-0.5 * dxy / w) for w in KERNEL_BANDWIDTHS
    )
    assert isinstance(total, torch.Tensor)
    if mask is None:
        return total.mean()
    weight = mask.to(total.dtype) / mask.sum()
    return (weight[:, None] * weight[None, :] * total).sum()


def fedcp_loss(body: int, body_names: list[str], lamda: float, tau: float, gumbel: bool) -> CarryLossFn:
    """CE of the CPN's routed logits + λ MMD(h, h_0); advances the noise key."""

    def head(p: Any, z: torch.Tensor, net: Net) -> torch.Tensor:
        return net(without_between(p), z, start=body)

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> tuple[torch.Tensor, Params]:
        h = net(params, batch.x, stop=body)
        # the received body is a model of its own (the authors' deepcopy): its training-mode batch
        # norm updates throwaway statistics, never the client's
        stats = {k: v.clone() for k, v in params.items() if k.endswith((".running_mean", ".running_var"))}
        h0 = net({**params, **stats, **{k: params[BASE + k] for k in body_names}}, batch.x, stop=body)
        noise = gumbel_noise(params[KEY], (h.shape[0], 2, h.shape[1]), h) if gumbel else None
        logits = CPN.logits(params, h, lambda p, z: head(p, z, net), tau, noise)
        value = cross_entropy(logits, batch) + lamda * mmd(h, h0.detach(), batch.mask)
        return value, {KEY: params[KEY] + 1}

    return loss


def per_client(ctx: ClientContext, purpose: str, draw: Any, like: torch.Tensor) -> torch.Tensor:
    """``draw(generator)`` for each of the context's clients from its ``purpose`` stream (stacked)."""
    values = [draw(ctx.generator(purpose, k)) for k in range(len(ctx.client_ids))]
    return (torch.stack(values) if ctx.client_shape else values[0]).to(like.device)


@register
class FedCP(RoutedMethod):
    name = "fedcp"
    settings_class = FedCPSettings
    settings: FedCPSettings
    ala_targets = {}
    ala_refusal = (
        "the received head is FedCP's frozen global head, and the scored model mixes it with the personal head "
        "sample by sample through the CPN, which ALA's objective on the plain model does not see"
    )

    route = CPN

    def __init__(self, settings: Any, train: Any, units: Any) -> None:
        super().__init__(settings, train, units)
        self.body_names = [n for n in self.parameter_names if n not in self.head]

    def check_model(self, model: torch.nn.Module) -> None:
        if not getattr(model, "linear_head", False):
            raise ValueError(
                f"{self.name} splits the features a linear head reads, and {type(model).__name__}'s head is no "
                "linear layer: choose a model with a linear head (digits_cnn, fedavg_cnn, resnet18, ...)"
            )

    def fresh_modules(self, like: torch.Tensor, seed: int) -> Params:
        """nn.Linear(d, 2d)'s default initialisation (U(±1/√d)) and a fresh layer norm."""
        d = like.shape[1]
        g, bound = torch_generator(seed, "fedcp-cpn"), d**-0.5
        uniform = lambda *shape: ((torch.rand(*shape, generator=g) * 2 - 1) * bound).to(like)  # noqa: E731
        n = CPN.name
        ones = torch.ones(2 * d, dtype=like.dtype, device=like.device)
        return {
            n("cpn.weight"): uniform(2 * d, d),
            n("cpn.bias"): uniform(2 * d),
            n("norm.weight"): ones,
            n("norm.bias"): torch.zeros_like(ones),
        }

    def init_client(self, init_params: Params, client_id: int) -> State:
        weight = init_params[self.head[0]]
        placeholder = {k: torch.zeros_like(v) for k, v in self.fresh_modules(weight, 0).items()}
        personal = {CPN.name("head." + k): init_params[k].clone() for k in self.head}
        context = {CPN.name("context"): torch.zeros_like(weight[0])}
        tau = {CPN.name("tau"): torch.tensor(self.settings.tau, dtype=weight.dtype, device=weight.device)}
        return {
            "model": clone(init_params),
            "between": {**placeholder, **personal, **context, **tau},
            "trained": torch.tensor(0.0),
        }

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        glob = payload["global"]
        model = {**state["model"], **clone(without_between(glob))}
        between = {**state["between"], **clone(CPN.entries(glob))}
        name = CPN.name("context")
        fresh = per_client(
            ctx, "fedcp-context", lambda g: torch.rand(between[name].shape[-1], generator=g), between[name]
        )
        trained = (
            state["trained"].to(fresh.device).reshape(*ctx.client_shape, *[1] * (fresh.dim() - len(ctx.client_shape)))
        )
        between[name] = torch.where(trained > 0, between[name], fresh.to(between[name].dtype))
        return {**state, "model": model, "between": between}, {}

    def eval_params(self, state: State) -> Params:
        return {**state["model"], **state["between"]}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        cfg = self.settings
        weight = state["model"][self.head[0]]
        key = per_client(ctx, "fedcp-noise", lambda g: torch.randint(0, 2**31 - 1, (), generator=g), weight)
        base = {BASE + k: state["model"][k] for k in self.body_names}
        personal = [CPN.name("head." + k) for k in self.head]
        shared = list(CPN.shared_entries(state["between"]))
        fit = ctx.fit(
            {**state["model"], **state["between"], **base, KEY: key},
            fedcp_loss(self.body, self.body_names, cfg.lamda, cfg.tau, cfg.gumbel),
            trainable=[*self.body_names, *shared, *personal],
            data=TrainBatches("train", self.train.local_epochs),
            carry=[KEY],
        )
        model = {k: fit.params[k] for k in state["model"]}
        between = {k: fit.params[k] for k in state["between"]}
        between[CPN.name("context")] = between[CPN.name("head." + self.head[0])].sum(-2)  # column sums of head_p
        uploaded = {**model, **{k: 0.5 * between[CPN.name("head." + k)] + 0.5 * model[k] for k in self.head}}
        new = {**state, "model": model, "between": between, "trained": torch.ones_like(state["trained"])}
        return new, self.upload({**uploaded, **CPN.shared_entries(between)}, ctx), {"train_loss": fit.loss}


FedCP.card = MethodCard(
    full_name="FedCP",
    paper=Paper(
        "FedCP: Separating Feature Information for Personalized Federated Learning via Conditional Policy",
        "Zhang et al.",
        2023,
        "KDD",
        "https://arxiv.org/abs/2307.01217",
    ),
    personalised=True,
    shares="The body, the CPN and 0.5 head_p + 0.5 head_g, with the training-set size; the server averages each "
    "(sample-weighted) into the next body, CPN and global head.",
    keeps="The personal head head_p and the context vector v.",
    scored="body, CPN, head_p(h·s_p) + head_g(h·s_g)",
    scored_detail="The CPN's masks without noise. Global accuracy scores the body with the global head.",
    client_round="Overwrite the body, the global head and the CPN with the received ones. Train the body, the "
    "CPN and head_p E epochs of SGD on CE(head_p(h·s_p) + head_g(h·s_g)) + λ MMD(h, h_0) (λ = 5): the masks "
    "come from a Gumbel softmax (τ = 1) of the CPN's scores of h·normalise(v), h_0 is the received body's "
    "feature, head_g is frozen. Set v to the column sums of head_p's weight. Upload the body, the CPN and "
    "0.5 head_p + 0.5 head_g.",
    references=(
        Reference(
            "TsingZ0/FedCP",
            "7110e97",
            (
                "system/flcore/clients/clientcp.py (train_cs_model, generate_upload_head, set_head_g, MMD, Ensemble)",
                "system/flcore/servers/servercp.py (ConditionalSelection, global_head, global_cs)",
                "system/run_me.sh (-lam 5)",
            ),
        ),
        Reference(
            "TsingZ0/PFLlib", "d832e76", ("system/flcore/clients/clientcp.py", "system/flcore/servers/servercp.py")
        ),
    ),
    tests=(
        "tests/methods/test_fedcp.py::test_fedcp_client_is_the_authors_train_cs_model",
        "tests/methods/test_fedcp.py::test_fedcp_server_averages_body_cpn_and_uploaded_heads_and_scores_both_heads",
        "tests/methods/test_fedcp.py::test_fedcp_without_noise_option_is_the_plain_softmax",
    ),
    differences=(
        "The authors draw Gumbel noise at test time too; pflkit scores the noise-free masks.",
        "pflkit's Gumbel noise is a hash of a per-client, per-round key and the step (the same on every engine), "
        "not torch's global generator.",
        "The authors' loader does not shuffle; pflkit's reshuffles every epoch.",
        "The authors send the body to every client each round; pflkit sends it to the round's clients.",
        "The authors (and PFLlib) give the averaged head_g and CPN back, at the end of a round, to that round's "
        "clients only: a client picked in a later round trains and is scored with the head_g and CPN of the "
        "last round it took part in. pflkit sends the current ones to a client when it takes part. With every "
        "client in every round (the paper's setting) the two are the same.",
        "A model whose head is no linear layer (squeezenet1_1) is refused.",
    ),
    choices=(
        Choice("λ (PFLlib's default: 1; the FedCP repository's main.py: 0)", "5, the authors' script", "`fedcp.lamda`"),
        Choice("Gumbel noise in training", "on (τ = 1), the authors'", "`fedcp.gumbel`, `fedcp.tau`"),
    ),
    notes=(
        "`train_loss` includes λ MMD.",
        "head_p, v and the CPN are entries between body and head (`between.fedcp.*`); checkpoints carry them and "
        "whether the client has trained, and a resumed run continues them.",
        "No `+ala`: the received head is the frozen global head, and the scored model mixes it with head_p "
        "sample by sample through the CPN, which ALA's objective on the plain model does not see.",
    ),
)

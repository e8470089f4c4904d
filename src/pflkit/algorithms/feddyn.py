"""FedDyn (Acar et al., ICLR 2021): federated learning with a dynamic regulariser.

Client i minimises L_i(θ) − ⟨g_i, θ⟩ + α/2 ‖θ − θ^{t−1}‖² from the received server model θ^{t−1},
where g_i (its "∇L_i", zero before its first round) is kept on the client and then updated as
g_i ← g_i − α (θ_i^t − θ^{t−1}). The server keeps h: h ← h − α/m Σ_{i∈P} (θ_i^t − θ^{t−1}) over
the round's participants P (m: every client of the federation), and sets
θ^t = (1/|P|) Σ_{i∈P} θ_i^t − h/α (an unweighted mean, as the paper and the authors' code).

Each local step is the authors' (``train_feddyn_mdl``): the gradient of CE − ⟨g_i + α θ^{t−1}, θ⟩ is
clipped to norm ``max_grad_norm`` (one norm per client), then α θ (the gradient of α/2 ‖θ‖²) is
added as weight decay, with the run's ``weight_decay``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from pydantic import Field

from ..functional import Params, WeightedSum, clone
from ..functional.training import SGD, ClosedFormTerm, LossFn, WithTerms, classification_loss
from .base import (
    ClientContext,
    CountsClients,
    Payload,
    SentUpload,
    Settings,
    State,
    Trained,
    require_entry,
    upload_order,
)
from .card import Choice, MethodCard, Paper, Reference
from .registry import register

#: server-state key of the state h
H = "feddyn_h"


class FedDynSettings(Settings):
    alpha: float = Field(0.01, gt=0, description="α, the weight of the dynamic regulariser (the authors' code: 0.01)")
    max_grad_norm: float = Field(
        10.0,
        ge=0,
        description="clip each local step's gradient to this global norm, per client, before the weight decay "
        "(the authors' code: 10; 0: no clipping)",
    )


def squared_norm(params: Params) -> torch.Tensor:
    """Σ_k ‖params_k‖²."""
    return cast(torch.Tensor, sum((v**2).sum() for v in params.values()))  # (sum's start 0 is absorbed)


def squared_norms(params: Params, client_shape: tuple[int, ...]) -> torch.Tensor:
    """Σ_k ‖params_k‖² of each client: a tensor of shape ``client_shape`` (the leading dimensions of
    the parameters in a batched context, none for one client)."""
    return cast(torch.Tensor, sum((v**2).reshape(*client_shape, -1).sum(-1) for v in params.values()))


@dataclass(frozen=True)
class DynamicTerms(ClosedFormTerm):
    """FedDyn's terms −⟨g, θ⟩ + α/2 ‖θ − anchor‖² over the parameters of ``aux["coef"]``, which holds
    g + α·anchor (``aux["anchor_sq"]``: ‖anchor‖²), both computed once per fit: the value
    −⟨g + α·anchor, θ⟩ + α/2 (‖θ‖² + ‖anchor‖²). The gradient added is −(g + α·anchor); the
    optimiser adds the quadratic part's α θ as weight decay (``FedDyn.optimizer``)."""

    alpha: float

    def add_value(self, value: torch.Tensor, params: Params, aux: Any) -> torch.Tensor:
        coef = aux["coef"]
        linear = sum((c * params[k]).sum() for k, c in coef.items())
        quadratic = self.alpha / 2 * (squared_norm({k: params[k].detach() for k in coef}) + aux["anchor_sq"])
        return value - linear + quadratic

    def gradient(self, params: Params, aux: Any) -> dict[str, torch.Tensor]:
        return {k: -c for k, c in aux["coef"].items()}

    def apply(self, value: torch.Tensor, params: Params, grads: dict[str, torch.Tensor], aux: Any) -> torch.Tensor:
        coef = aux["coef"]
        names = list(coef)
        theta = [params[k].detach() for k in names]
        linear = sum(s.sum() for s in torch._foreach_mul([coef[k] for k in names], theta))
        quadratic = self.alpha / 2 * (sum(s.sum() for s in torch._foreach_mul(theta, theta)) + aux["anchor_sq"])
        trained = [k for k in names if k in grads]
        grads.update(zip(trained, torch._foreach_sub([grads[k] for k in trained], [coef[k] for k in trained])))
        return value - linear + quadratic


def feddyn_loss(alpha: float) -> LossFn:
    """CE − ⟨g, θ⟩ + α/2 ‖θ − anchor‖² (:class:`DynamicTerms`): training differentiates the CE and
    adds the rest in closed form."""
    return WithTerms(classification_loss, (DynamicTerms(alpha),))


class FedDynStep:
    """The server rule as an ``Aggregator``: the uploads' plain sum, folded in ``upload_order``, then
    the mean of the participants, the update of h and θ^t = mean − h/α."""

    def __init__(self, method: FedDyn, server: State) -> None:
        self.method, self.server = method, server
        self.models = WeightedSum()

    def add(self, upload: SentUpload) -> None:
        self.models.add(upload["params"])

    def result(self) -> State:
        if self.models.sum is None:
            raise ValueError("feddyn: cannot aggregate a round without uploads")
        server, alpha = self.server, self.method.settings.alpha
        m, state_h = self.method.num_clients(server), require_entry("feddyn", server, H)
        old, total, count = server["global"], self.models.sum, self.models.added
        mean = self.models.result()
        names = [k for k in self.method.parameter_names if k in mean]
        h = {**state_h, **{k: state_h[k] - alpha / m * (total[k] - count * old[k]) for k in names}}
        new = {**old, **mean, **{k: mean[k] - h[k] / alpha for k in names}}
        return {**server, "global": new, H: h}


@register
class FedDyn(CountsClients):
    name = "feddyn"
    settings_class = FedDynSettings
    settings: FedDynSettings

    def init_server(self, init_params: Params) -> State:
        server = super().init_server(init_params)
        return {**server, H: {k: torch.zeros_like(v) for k, v in self.parameters_of(init_params).items()}}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        step = FedDynStep(self, server)
        for upload in sorted(uploads, key=upload_order):
            step.add(upload)
        return step.result()

    def aggregator(self, server: State, round: int, total: float) -> FedDynStep:
        return FedDynStep(self, server)

    def init_client(self, init_params: Params, client_id: int) -> State:
        grad = {k: torch.zeros_like(v) for k, v in self.parameters_of(init_params).items()}
        return {"model": clone(init_params), "grad": grad}

    def optimizer(self, ctx: ClientContext) -> SGD:
        """The run's SGD with α added to its weight decay, clipping at ``max_grad_norm`` (0: none)."""
        sgd = ctx.train.optimizer(clip_norm=self.settings.max_grad_norm or None)
        return replace(sgd, weight_decay=sgd.weight_decay + self.settings.alpha)

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        anchor = self.parameters_of(payload["global"])
        alpha = self.settings.alpha
        coef = {k: state["grad"][k] + alpha * a for k, a in anchor.items()}
        aux = {"coef": coef, "anchor_sq": squared_norms(anchor, ctx.client_shape)}
        fit = self.train_model(state["model"], ctx, feddyn_loss(alpha), aux=aux, optimizer=self.optimizer(ctx))
        grad = {**state["grad"], **{k: state["grad"][k] - alpha * (fit.params[k] - a) for k, a in anchor.items()}}
        return (
            {**state, "model": fit.params, "grad": grad},
            self.upload(self.shared(fit.params), ctx),
            {"train_loss": fit.loss},
        )


FedDyn.card = MethodCard(
    full_name="FedDyn",
    paper=Paper(
        "Federated Learning Based on Dynamic Regularization",
        "Acar et al.",
        2021,
        "ICLR",
        "https://arxiv.org/abs/2111.04263",
    ),
    personalised=False,
    shares="The whole model. The server averages the participants' models with equal weights and "
    "corrects the average by its state h.",
    keeps="The client keeps its linear-term state ∇L_i (zero before its first round). The server keeps h "
    "and the number of clients m.",
    scored="the received global",
    client_round="Overwrite the local model with the received server model θ. Train E epochs of SGD on "
    "CE − ⟨∇L_i, w⟩ + α/2‖w − θ‖² (α = 0.01), each step's gradient clipped at norm 10 before α w is added as "
    "weight decay (the authors' step). Update ∇L_i ← ∇L_i − α(w − θ). Upload the model. "
    "The server sets h ← h − α/m Σ(w_i − θ) over the participants and θ ← mean(w_i) − h/α.",
    references=(
        Reference(
            "alpemreacar/FedDyn",
            "48a19fa",
            ("utils_methods.py (train_FedDyn)", "utils_general.py (train_feddyn_mdl)", "example_cifar_10.py"),
        ),
        Reference(
            "TsingZ0/PFLlib", "f1e313a", ("system/flcore/clients/clientdyn.py", "system/flcore/servers/serverdyn.py")
        ),
    ),
    tests=(
        "tests/methods/test_feddyn.py::test_feddyn_rounds_match_the_authors_train_feddyn",
        "tests/methods/test_feddyn.py::test_feddyn_clipped_rounds_match_the_authors_train_feddyn",
        "tests/methods/test_feddyn.py::test_feddyn_server_is_algorithm_1",
        "tests/methods/test_feddyn.py::test_feddyn_matches_pfllib_with_a_squared_regulariser",
        "tests/methods/test_feddyn.py::test_feddyn_reports_the_objective_it_minimises_as_its_training_loss",
    ),
    pinned=("tests/methods/test_feddyn.py::test_pfllib_feddyn_differs_by_its_unsquared_regulariser",),
    differences=(
        "The paper's Algorithm 1 prints h ← h − α/m (Σ_{i∈P} θ_i − θ^{t−1}), which reads as subtracting θ^{t−1} once. "
        "The authors' code and PFLlib subtract it once per participant, Σ_{i∈P}(θ_i − θ^{t−1}), and PFLlib's "
        "maintainer gives that reading (https://github.com/TsingZ0/PFLlib/issues/29). pflkit follows the "
        "authors' code: with the printed form, h grows with the "
        "number of participants.",
        "PFLlib's client adds α/2 ‖θ − θ^{t−1}‖ (the norm, not its square). pflkit follows the paper and the "
        "authors' code: the squared norm.",
        "The authors scale α per client by its share of the data (α_i = α N / (m n_i), the same α when every "
        "client holds as many samples). pflkit uses one α for every client, as the paper.",
        "The authors clip each step's gradient at norm 10, then add α θ and 1e-3 θ as weight decay. pflkit "
        "clips the same gradient (`feddyn.max_grad_norm`, 10) and adds α θ after it; the 1e-3 is the run's "
        "`weight_decay` (default 0).",
        "The authors train on every batch, the last partial one too. pflkit trains on full batches.",
        "Batch-norm statistics: pflkit takes their unweighted mean without correction. PFLlib takes them from the "
        "first upload.",
        "The scored model: pflkit and PFLlib score the server's corrected model, mean(θ_i) − h/α. The authors' "
        "code never scores it: it reports the mean of the round's client models (`tst_perf_sel`) and the mean "
        "of every client's latest model (`tst_perf_all`, the curve their example plots). The two differ by "
        "the accumulated h/α.",
    ),
    choices=(
        Choice("α, the regulariser's weight (the paper: 0.1, 0.01 or 0.001; PFLlib: 1)", "0.01", "feddyn.alpha"),
        Choice("the gradient norm each local step is clipped at (0: none; PFLlib: none)", "10", "feddyn.max_grad_norm"),
    ),
    notes=(
        "`train_loss` includes the linear and quadratic terms.",
        "∇L_i is client state and h server state: checkpoints carry them and a resumed run continues them.",
        "The clipping keeps the digits demo's setting (lr 0.1, Dir(0.1), 20 small clients) finite at seeds 0-4. "
        "Without it (`feddyn.max_grad_norm = 0`) that setting diverges: at seed 1 the training loss grows past 200 "
        "between rounds 35 and 60 and the accuracy falls to chance.",
    ),
    ala_initialises="the local model; the regulariser's anchor stays the received server model",
)

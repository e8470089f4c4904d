"""APFL (Deng et al., 2020): a local copy w of the global model, a personal model v and a mixing
weight alpha per client.

Per mini-batch (Algorithm 1, every gradient at the values before the step, on the same batch):
w <- w - lr grad f(w); v <- v - lr grad_v f(v_bar); alpha <- alpha - lr_alpha grad_alpha f(v_bar),
clipped to [0, 1], with v_bar = alpha v + (1 - alpha) w. One loss gives all three:
f(w) + f(alpha v + (1 - alpha) sg(w)), sg stopping the gradient. The client uploads w; the server
averages as FedAvg. Scored model: alpha v + (1 - alpha) w with w the received global.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from ..functional import Params, clone, scale
from ..functional.training import Batch, LossFn, Net, cross_entropy
from .base import Algorithm, ClientContext, Payload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .registry import register

V = "apfl.v/"  # prefix of the personal model's entries among the tensors a fit trains
A = "apfl.alpha"  # the mixing weight among them


class APFLSettings(Settings):
    alpha: float = Field(0.5, ge=0, le=1, description="initial mixing weight alpha (the authors' default: 0.5)")
    alpha_lr: float | None = Field(
        None,
        ge=0,
        description="learning rate of alpha; None: the local lr (PFLlib's); 0: alpha stays fixed",
    )
    alpha_decay: float = Field(
        0.0,
        ge=0,
        description="adds alpha_decay * alpha to alpha's gradient (the paper: 0; PFLlib and the authors' code: 0.02)",
    )


def mixed(params: Params, names: list[str], alpha: torch.Tensor, stop_w: bool = False) -> Params:
    """alpha v + (1 - alpha) w over the parameters ``names`` (v under ``V``); the buffers are v's.
    ``alpha`` is [] or [K]; ``stop_w``: no gradient flows into w."""
    out = {k[len(V) :]: v for k, v in params.items() if k.startswith(V)}
    for k in names:
        w = params[k].detach() if stop_w else params[k]
        out[k] = scale(alpha, params[V + k]) + scale(1 - alpha, w)
    return out


def apfl_loss(names: list[str], alpha_decay: float) -> LossFn:
    """f(w) + f(alpha v + (1 - alpha) sg(w)) (+ alpha_decay / 2 * alpha^2)."""

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> torch.Tensor:
        w = {k: v for k, v in params.items() if not k.startswith(V) and k != A}
        value = cross_entropy(net(w, batch.x), batch)
        value = value + cross_entropy(net(mixed(params, names, params[A], stop_w=True), batch.x), batch)
        return value + alpha_decay / 2 * params[A] ** 2 if alpha_decay else value

    return loss


def clip_alpha(params: Params) -> None:
    params[A].clamp_(0.0, 1.0)


@register
class APFL(Algorithm):
    name = "apfl"
    settings_class = APFLSettings
    settings: APFLSettings

    def init_client(self, init_params: Params, client_id: int) -> State:
        device = next(iter(init_params.values())).device
        alpha = torch.tensor(self.settings.alpha, device=device)
        return {"model": clone(init_params), "personal": clone(init_params), "alpha": alpha}

    def eval_params(self, state: State) -> Params:
        params = {**state["model"], **{V + k: v for k, v in state["personal"].items()}}
        return mixed(params, self.parameter_names, state["alpha"])

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        cfg = self.settings
        names = self.parameter_names
        alpha_lr = ctx.train.lr if cfg.alpha_lr is None else cfg.alpha_lr
        learn_alpha = alpha_lr > 0
        params = {**state["model"], **{V + k: v for k, v in state["personal"].items()}, A: state["alpha"]}
        fit = self.train_model(
            params,
            ctx,
            apfl_loss(names, cfg.alpha_decay),
            trainable=[*names, *(V + k for k in names), *([A] if learn_alpha else [])],
            optimizer=ctx.train.optimizer(plain=[A], **{A: alpha_lr}),  # alpha: its own rate, no momentum
            transform=clip_alpha if learn_alpha else None,
        )
        model = {k: fit.params[k] for k in state["model"]}
        personal = {k: fit.params[V + k] for k in state["personal"]}
        new_state = {**state, "model": model, "personal": personal, "alpha": fit.params[A]}
        return new_state, self.upload(model, ctx), {"train_loss": fit.loss, "alpha": fit.params[A]}


APFL.card = MethodCard(
    full_name="APFL",
    paper=Paper(
        "Adaptive Personalized Federated Learning",
        "Deng et al.",
        2020,
        "arXiv",
        "https://arxiv.org/abs/2003.13461",
    ),
    personalised=True,
    shares="Its local copy w of the global model and its training-set size; the server averages them as FedAvg.",
    keeps="The personal model v and the mixing weight α.",
    scored="the mixture α v + (1 − α) w",
    scored_detail="With w the received global, v and α from the client's last round.",
    client_round="Overwrite w with the received global. For E epochs, per batch: step w on f(w); step v on "
    "f(α v + (1 − α) w); step α on the same mixture and clip it to [0, 1]. Every gradient is taken before "
    "the step. α starts at 0.5; its lr is the local lr. Upload w.",
    references=(
        Reference(
            "TsingZ0/PFLlib",
            "f1e313a",
            ("clients/clientapfl.py (train, alpha_update)", "servers/serverapfl.py", "main.py (--alpha)"),
        ),
        Reference(
            "MLOPTPSU/FedTorch",
            "ab8068d",
            (
                "fedtorch/comms/trainings/federated/apfl.py",
                "fedtorch/comms/utils/flow_utils.py (alpha_update)",
                "fedtorch/comms/utils/eval.py (inference_personal)",
                "fedtorch/parameters.py",
            ),
        ),
    ),
    tests=(
        "tests/methods/test_apfl.py::test_apfl_is_algorithm_1_of_the_paper_step_by_step",
        "tests/methods/test_apfl.py::test_apfl_options_fix_alpha_and_add_the_references_alpha_term",
        "tests/methods/test_apfl.py::test_apfl_steps_alpha_by_plain_sgd_under_the_runs_momentum_and_weight_decay",
    ),
    pinned=("tests/methods/test_apfl.py::test_apfl_personal_step_is_pfllibs",),
    differences=(
        "pflkit follows the paper's Algorithm 1; the tests compare it with a step-by-step transcription of it.",
        "PFLlib (f1e313a) steps v on f(v), not on the mixture. Its α gradient is Σ (v − w)·(α ∇f(v) + "
        "(1 − α) ∇f(w)) + 0.02 α, with v and w after their steps. After training it replaces v by α v + "
        "(1 − α) w. It starts α at 1.0 and scores the received global (later versions score v).",
        "The authors' code (FedTorch) mixes outputs, α v(x) + (1 − α) w(x), not parameters. It steps v after "
        "w on the same batch. By default α stays at 0.5; with `fed_adaptive_alpha` it steps α once per "
        "round, with PFLlib's formula, fed the gradients of the mixed output's loss. It scores the personal "
        "model with the client's trained w, not the received global.",
        "The server: FedTorch averages the uploaded w uniformly over the round's clients (`fedavg_aggregation`); "
        "PFLlib and pflkit weight them by training-set size.",
    ),
    choices=(
        Choice("initial α", "0.5 (FedTorch's default; PFLlib's is 1.0)", "`apfl.alpha`"),
        Choice("α's learning rate", "the local lr (PFLlib's)", "`apfl.alpha_lr` (0: α fixed, FedTorch's default)"),
        Choice("the references' 0.02 α term in α's gradient", "off (the paper)", "`apfl.alpha_decay = 0.02`"),
    ),
    notes=(
        "`train_loss` is f(w) + f(α v + (1 − α) w). Batch-norm statistics of the mixture are v's.",
        "`alpha` is the mean α of the round's clients after training.",
    ),
    ala_initialises="the local copy w of the global model",
)

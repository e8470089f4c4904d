"""FedAvg-C (FedALA paper baseline, reconstructed: the paper gives no code): FedAvg plus local
fine-tuning of the downloaded global model before evaluation and training.

No code is public; the paper only says the global model is "locally fine-tuned for local
initialisation at each iteration". Here: after receiving Theta^{t-1} the client fine-tunes all
parameters for ``ft_epochs`` epochs of SGD at the local lr (or until the epoch loss settles, like
ALA's start phase); the fine-tuned model is evaluated and is the start of local training.
Evaluated model: the fine-tuned one. With ``+ala`` ALA initialises the local model, which is
then fine-tuned.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from ..functional.training import LossFn, classification_loss
from .base import Algorithm, ClientContext, Init, Payload, Settings, State, Trained
from .card import Choice, MethodCard, Paper
from .context import TrainBatches
from .registry import register

#: The paper that introduced FedAvg-C and FedProx-C as baselines.
FEDALA_PAPER = Paper(
    "FedALA: Adaptive Local Aggregation for Personalized Federated Learning",
    "Zhang et al.",
    2023,
    "AAAI",
    "https://arxiv.org/abs/2212.01197",
)
#: The choices FedAvg-C and FedProx-C share.
FINE_TUNING_CHOICES = (
    Choice(
        "fine-tuning length",
        "1 epoch",
        "`ft_epochs`, or `ft_until_converged` (ALA's loss-std criterion: `ft_threshold`, `ft_window`, `ft_max_epochs`)",
    ),
    Choice("what local training starts from", "the fine-tuned model", '`upload_from = "global"`'),
)


class FineTuneSettings(Settings):
    ft_epochs: int = Field(1, ge=1, description="fine-tuning epochs per round")
    ft_until_converged: bool = Field(
        False,
        description="fine-tune until the std of the last ft_window epochs' "
        "last-batch losses < ft_threshold (ALA's criterion), capped by "
        "ft_max_epochs",
    )
    ft_threshold: float = Field(0.01, gt=0, description="convergence threshold with ft_until_converged")
    ft_window: int = Field(10, ge=2, description="epochs in the convergence window")
    ft_max_epochs: int = Field(50, ge=1, description="cap on fine-tuning epochs with ft_until_converged")
    upload_from: Literal["finetuned", "global"] = Field(
        "finetuned",
        description="start local training from the fine-tuned or the raw received model",
    )


class FineTuning(Algorithm):
    """Fine-tune the received model in ``after_receive``; local training starts from it."""

    settings: FineTuneSettings

    def finetune_loss(self) -> LossFn:
        """The fine-tuning objective: cross-entropy (FedProx-C may add its proximal term)."""
        return classification_loss

    def finetune_options(self, ctx: ClientContext) -> dict[str, Any]:
        """More arguments of the fine-tuning ``ctx.fit`` (FedBABU: its optimiser, what it trains);
        default: none (all parameters, the run's SGD)."""
        return {}

    def after_receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        cfg = self.settings
        aux = self.loss_aux(payload, state, ctx)
        options = self.finetune_options(ctx)
        if not cfg.ft_until_converged:
            fit = ctx.fit(
                state["model"],
                self.finetune_loss(),
                aux=aux,
                data=TrainBatches("finetune", cfg.ft_epochs),
                stage="fine-tuning",
                **options,
            )
            return {**state, "model": fit.params}, {"ft_loss": fit.loss}

        def settled(losses: list[float], client: int) -> bool:
            return len(losses) >= cfg.ft_window and float(np.std(losses[-cfg.ft_window :])) < cfg.ft_threshold

        fit = ctx.fit(
            state["model"],
            self.finetune_loss(),
            aux=aux,
            data=TrainBatches("finetune"),
            until=settled,
            max_epochs=cfg.ft_max_epochs,
            stage="fine-tuning",
            **options,
        )
        return {**state, "model": fit.params}, {"ft_loss": fit.loss, "ft_epochs": fit.epochs}

    def training_start(self, payload: Payload, state: State) -> dict[str, Any]:
        if self.settings.upload_from == "global":
            return {**state["model"], **payload["global"]}
        return state["model"]

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        fit = self.train_model(
            self.training_start(payload, state), ctx, self.loss(), aux=self.loss_aux(payload, state, ctx)
        )
        return {**state, "model": fit.params}, self.upload(fit.params, ctx), {"train_loss": fit.loss}


@register
class FedAvgC(FineTuning):
    name = "fedavgc"
    settings_class = FineTuneSettings


FedAvgC.card = MethodCard(
    full_name="FedAvg-C",
    paper=FEDALA_PAPER,
    personalised=True,
    shares="The whole model and its training-set size; the server averages them as FedAvg.",
    keeps="Nothing between rounds: the received global model overwrites the local one.",
    scored="the fine-tuned model",
    client_round="Overwrite the local model with the received global. Fine-tune all parameters for "
    "`ft_epochs` = 1 epoch of SGD at the local lr. The fine-tuned model is scored. FedAvg training "
    "then starts from it. Upload the model.",
    no_reference="No author code exists: the FedALA paper, which uses it as a baseline, only says the "
    "global model is locally fine-tuned. PFLlib's `fine_tuning_epoch_new` is for new clients.",
    tests=(
        "tests/methods/test_fedavgc.py::test_finetuned_methods_evaluate_the_finetuned_global_and_train_from_it",
        "tests/methods/test_fedavgc.py::test_finetuning_options_two_epochs_converged_and_training_from_the_raw_global",
    ),
    choices=FINE_TUNING_CHOICES,
    reconstruction=True,
    ala_initialises="the local model, which is then fine-tuned",
)

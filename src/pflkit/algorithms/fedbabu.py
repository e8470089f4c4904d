"""FedBABU (Oh et al., ICLR 2022): federate the body with the head frozen at its initialisation;
personalise by fine-tuning.

Round: receive the global model (trained body, the initial head every client shares); fine-tune a
copy of it for ``ft_epochs`` = 5 epochs (the whole model, as the authors' evaluation does) through
FedAvg-C's fine-tuning path, and score it; then train the body alone for E epochs from the received
model, the head frozen, and upload the body. Server: the sample-weighted average of the bodies; the
head is never updated.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..models import head_names
from .base import ClientContext, Payload, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .fedavgc import FineTuneSettings, FineTuning
from .registry import register


class FedBABUSettings(FineTuneSettings):
    ft_epochs: int = Field(5, ge=1, description="fine-tuning epochs before scoring (the authors' evaluation: 5)")
    ft_part: Literal["full", "head"] = Field(
        "full", description="what fine-tuning trains: the whole model (the paper's) or the head alone"
    )
    ft_lr: float | None = Field(
        None, gt=0, description="fine-tuning learning rate; None: the local lr (the authors' evaluation: 0.001)"
    )
    upload_from: Literal["global"] = Field(
        "global",
        description="federated training always starts from the received model, whose head is the initial one",
    )


@register
class FedBABU(FineTuning):
    name = "fedbabu"
    settings_class = FedBABUSettings
    settings: FedBABUSettings
    body_use = "trains the model's body with its head frozen"

    def finetune_options(self, ctx: ClientContext) -> dict[str, Any]:
        cfg = self.settings
        options: dict[str, Any] = {"optimizer": ctx.train.optimizer(cfg.ft_lr)}
        if cfg.ft_part == "head":
            options["trainable"] = head_names(self.units)
        return options

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        head = set(head_names(self.units))
        body = [k for k in self.parameter_names if k not in head]
        fit = self.train_model(self.training_start(payload, state), ctx, self.loss(), trainable=body)
        upload = {k: v for k, v in fit.params.items() if k not in head}
        return {**state, "model": fit.params}, self.upload(upload, ctx), {"train_loss": fit.loss}


FedBABU.card = MethodCard(
    full_name="FedBABU",
    paper=Paper(
        "FedBABU: Toward Enhanced Representation for Federated Image Classification",
        "Oh et al.",
        2022,
        "ICLR",
        "https://arxiv.org/abs/2106.06042",
    ),
    personalised=True,
    shares="The body (every unit but the head) and the training-set size; the server averages the bodies. "
    "The head stays at its initialisation, the same on every client.",
    keeps='Nothing between rounds but its batch-norm statistics (with the default `bn_buffers = "local"`): '
    "the received body overwrites the local one.",
    scored="the received model fine-tuned",
    scored_detail="The whole model fine-tuned for `ft_epochs` = 5 epochs at the local lr.",
    client_round="Receive the global model. Fine-tune all of it for 5 epochs of SGD (`ft_epochs`) and score "
    "it. Then, from the received model, train the body alone for E epochs, the head frozen. Upload the body.",
    references=(
        Reference(
            "TsingZ0/PFLlib",
            "f1e313a",
            ("clients/clientbabu.py (train, set_parameters, fine_tune)", "servers/serverbabu.py", "main.py"),
        ),
        Reference(
            "jhoon-oh/FedBABU",
            "e34c15b",
            ("main_fed.py", "models/Update.py (LocalUpdate.train)", "analysis.ipynb (personalization)"),
        ),
    ),
    tests=(
        "tests/methods/test_fedbabu.py::test_fedbabu_round_is_pfllibs_body_training_and_body_average",
        "tests/methods/test_fedbabu.py::test_fedbabu_scores_the_authors_whole_model_fine_tuning",
    ),
    pinned=("tests/methods/test_fedbabu.py::test_fedbabu_fine_tuning_is_pfllibs",),
    differences=(
        "pflkit fine-tunes and scores in every round, as FedAvg-C does. PFLlib and the authors fine-tune "
        "once, after the last round, and score the global model before that.",
        "PFLlib's `fine_tune` steps an optimiser over the body alone, so its head never moves (1 epoch by "
        "default). The authors fine-tune the whole model for 5 epochs.",
        "The authors fine-tune at lr 0.001 with momentum 0.9 after training at lr 0.1; pflkit uses the "
        "local lr and the run's momentum unless `fedbabu.ft_lr` is set.",
        "The authors (jhoon-oh/FedBABU at e34c15b, `main_fed.py`) average the bodies uniformly over the "
        "round's clients, batch-norm statistics included, and broadcast them to every client; pflkit weights "
        "by training-set size (PFLlib's) and keeps each client's statistics unless `bn_buffers = \"global\"`. "
        "The authors decay the lr by 10 at half and three quarters of the rounds, and fine-tune the model "
        "saved at the round of best test accuracy, not the last one.",
    ),
    choices=(
        Choice("what fine-tuning trains", "the whole model (the authors')", '`fedbabu.ft_part = "head"`'),
        Choice("fine-tuning learning rate", "the local lr", "`fedbabu.ft_lr`"),
    ),
    ala_initialises="the model that is fine-tuned and scored (its head is the global one; training starts "
    "from the received model either way)",
)

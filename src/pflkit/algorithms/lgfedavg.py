"""LG-FedAvg (Liang et al., 2020): a personal body (local representation), a shared head.

Round: take the received head (the body stays the client's own); train body and head together for
E epochs; upload the head. Server: the sample-weighted average of the heads. Scored model: the
client's own body under the latest received head. All of it is ``personal_part = "body"``.
"""

from __future__ import annotations

from pydantic import Field

from .base import Algorithm, Settings
from .card import MethodCard, Paper, Reference
from .registry import register


class LGFedAvgSettings(Settings):
    global_units: int = Field(
        1,
        ge=1,
        description="the model's top units that are global, shared and averaged (PFLlib: 1, the linear head; "
        "the authors' num_layers_keep counts layers the same way on their MNIST MLP)",
    )


@register
class LGFedAvg(Algorithm):
    name = "lgfedavg"
    settings_class = LGFedAvgSettings
    settings: LGFedAvgSettings
    personal_part = "body"
    has_global_model = False  # the server never trains a body

    @property
    def head_units(self) -> int:
        return self.settings.global_units


LGFedAvg.card = MethodCard(
    full_name="LG-FedAvg",
    paper=Paper(
        "Think Locally, Act Globally: Federated Learning with Local and Global Representations",
        "Liang et al.",
        2020,
        "arXiv",
        "https://arxiv.org/abs/2001.01523",
    ),
    personalised=True,
    shares="The head (the model's last unit) and the training-set size; the server averages the heads.",
    keeps="The body (the local representation) and its batch-norm statistics, which are never sent.",
    scored="the local body with the global head",
    client_round="Overwrite the head with the received one. Train body and head together for E epochs of "
    "SGD. Upload the head.",
    references=(
        Reference(
            "TsingZ0/PFLlib",
            "ad7bcd6",
            ("clients/clientlg.py", "servers/serverlg.py", "clients/clientbase.py", "servers/serverbase.py"),
        ),
    ),
    tests=("tests/methods/test_lgfedavg.py::test_lgfedavg_is_pfllib_clientlg_joint_epochs_and_a_head_only_server",),
    differences=(
        "PFLlib f1e313a has no LG-FedAvg: the reference is ad7bcd6, the commit that adds it.",
        "The global part is the model's last unit (its linear head) by default, as in PFLlib; "
        "`lgfedavg.global_units` makes more top units global. The authors' code "
        "(pliang279/LG-FedAvg at 7af0568, `main_lg.py`) makes the last `num_layers_keep` entries of a model's "
        "`weight_keys` global: the MLP's top three layers on MNIST, but on CIFAR-10 its CNN lists its layers "
        "as fc1, fc2, fc3, conv2, conv1, so the two convolutions are global and the fully connected layers local.",
        "The authors start every client from a pretrained FedAvg checkpoint (`--load_fed`), average the "
        "global layers uniformly over the round's clients, train with SGD momentum 0.5 on every batch (the "
        "last one smaller), and report each client's best model so far by test accuracy. pflkit starts from "
        "the run's initial model, weights by training-set size (PFLlib's), uses the run's optimiser and "
        "scores every client's current model.",
        "PFLlib's loader at ad7bcd6 does not shuffle: every epoch visits the batches in one order. pflkit "
        "reshuffles every epoch; the transcription test feeds both the same batches.",
        "A client with fewer samples than one batch trains on one batch of all of them. PFLlib's "
        "`drop_last` skips it (docs/explanations/design.md).",
    ),
    ala_initialises="the head (only the head is downloaded: ALA blends it whatever `p`)",
)

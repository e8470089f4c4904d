"""FedPer (Arivazhagan et al., 2019): a shared body, a personal head on every client.

Round: take the received body (the head stays the client's own); train body and head together for
E epochs; upload the body. Server: the sample-weighted average of the bodies. Scored model: the
client's own head on the latest received body. All of it is ``personal_part = "head"``.
"""

from __future__ import annotations

from pydantic import Field

from .base import Algorithm, Settings
from .card import MethodCard, Paper, Reference
from .registry import register


class FedPerSettings(Settings):
    personal_units: int = Field(
        1,
        ge=1,
        description="K_P, the model's top units kept on each client as its personal layers (PFLlib: 1, the "
        "linear head; the paper: 2 to 4 layers)",
    )


@register
class FedPer(Algorithm):
    name = "fedper"
    settings_class = FedPerSettings
    settings: FedPerSettings
    personal_part = "head"
    has_global_model = False  # the server never trains a head

    @property
    def head_units(self) -> int:
        return self.settings.personal_units


FedPer.card = MethodCard(
    full_name="FedPer",
    paper=Paper(
        "Federated Learning with Personalization Layers",
        "Arivazhagan et al.",
        2019,
        "arXiv",
        "https://arxiv.org/abs/1912.00818",
    ),
    personalised=True,
    shares="The body (every unit but the head) and the training-set size; the server averages the bodies.",
    keeps="The head, which is never sent.",
    scored="the global body with the local head",
    client_round="Overwrite the body with the received one. Train body and head together for E epochs of "
    "SGD. Upload the body.",
    references=(
        Reference(
            "TsingZ0/PFLlib",
            "f1e313a",
            ("clients/clientper.py", "servers/serverper.py", "clients/clientbase.py", "servers/serverbase.py"),
        ),
    ),
    tests=("tests/methods/test_fedper.py::test_fedper_is_pfllib_clientper_joint_epochs_and_a_body_only_server",),
    differences=(
        "The personal layers are the model's last unit (its linear head) by default, as in PFLlib; "
        "`fedper.personal_units` keeps more top units personal (the paper's K_P of two to four layers).",
        "A client with fewer samples than one batch trains on one batch of all of them. PFLlib's "
        "`drop_last` skips it (docs/explanations/design.md).",
    ),
    ala_initialises="the body (only the body is downloaded; `p` counts units among the downloaded ones)",
)

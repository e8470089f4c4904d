"""FedPer (Arivazhagan et al., 2019): a shared body, a personal head on every client.

Round: take the received body (the head stays the client's own); train body and head together for
E epochs; upload the body. Server: the sample-weighted average of the bodies. Scored model: the
client's own head on the latest received body. All of it is ``personal_part = "head"``.
"""

from __future__ import annotations

from .base import Algorithm
from .card import MethodCard, Paper, Reference
from .registry import register


@register
class FedPer(Algorithm):
    name = "fedper"
    personal_part = "head"
    has_global_model = False  # the server never trains a head


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
        "The personal layers are the model's last unit (its linear head), as in PFLlib. The paper also "
        "keeps two to four top layers personal.",
        "A client with fewer samples than one batch trains on one batch of all of them. PFLlib's "
        "`drop_last` skips it (docs/explanations/design.md).",
    ),
    ala_initialises="the body (only the body is downloaded; `p` counts units among the downloaded ones)",
)

"""FedAvg (McMahan et al., AISTATS 2017): overwrite, E epochs of SGD, sample-weighted average.

Everything is the ``Algorithm`` default: ``receive`` overwrites the local model with the global,
``local_train`` minimises cross-entropy, ``aggregate`` averages by sample counts. Evaluated
model: the downloaded global model, which is the local model right after
``local_init``.
"""

from __future__ import annotations

from .base import Algorithm
from .card import MethodCard, Paper, Reference
from .registry import register


@register
class FedAvg(Algorithm):
    name = "fedavg"


FedAvg.card = MethodCard(
    full_name="FedAvg",
    paper=Paper(
        "Communication-Efficient Learning of Deep Networks from Decentralized Data",
        "McMahan et al.",
        2017,
        "AISTATS",
        "https://arxiv.org/abs/1602.05629",
    ),
    personalised=False,
    shares="The whole model and its training-set size; the server averages the models by sample count.",
    keeps="Nothing between rounds: the received global model overwrites the local one.",
    scored="the received global",
    client_round="Overwrite the local model with the received global. Train E epochs of SGD on "
    "cross-entropy. Upload the model.",
    references=(
        Reference(
            "TsingZ0/PFLlib",
            "f1e313a",
            ("clients/clientavg.py", "clients/clientbase.py", "servers/serveravg.py", "servers/serverbase.py"),
        ),
    ),
    tests=("tests/methods/test_fedavg.py::test_fedavg_is_pfllib_clientavg_sgd_and_serverbase_sample_weighted_average",),
    differences=(
        "A client with fewer samples than one batch trains on one batch of all of them. PFLlib's "
        "`drop_last` skips it (docs/explanations/design.md).",
    ),
)

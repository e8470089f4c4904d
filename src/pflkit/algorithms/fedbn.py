"""FedBN (Li et al., ICLR 2021): FedAvg with every batch-norm layer kept on the client.

Round: take the received model without its batch-norm layers (the client's own affine weights and
running statistics stay); train the whole model for E epochs; upload everything but the batch-norm
layers. Server: the sample-weighted average of the uploads. Scored model: the client's own, local
batch norm and all. All of it is ``personal_part = "norm"``; a model without batch norm is refused.
"""

from __future__ import annotations

from .base import Algorithm
from .card import MethodCard, Paper, Reference
from .registry import register


@register
class FedBN(Algorithm):
    name = "fedbn"
    personal_part = "norm"
    has_global_model = False  # the server's model has no batch-norm layers of its own


FedBN.card = MethodCard(
    full_name="FedBN",
    paper=Paper(
        "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization",
        "Li et al.",
        2021,
        "ICLR",
        "https://arxiv.org/abs/2102.07623",
    ),
    personalised=True,
    shares="Every parameter outside the batch-norm layers, and the training-set size; the server averages them.",
    keeps="Each batch-norm layer: its affine weight and bias and its running mean and variance, never sent.",
    scored="the global layers with the local batch norm",
    client_round="Overwrite every layer but batch norm with the received one. Train the whole model for E "
    "epochs of SGD. Upload every layer but batch norm.",
    references=(
        Reference("med-air/FedBN", "2fa38ad", ("federated/fed_digits.py", "nets/models.py")),
        Reference(
            "TsingZ0/PFLlib",
            "f1e313a",
            ("clients/clientbn.py", "servers/serverbn.py", "clients/clientbase.py", "servers/serverbase.py"),
        ),
    ),
    tests=(
        "tests/methods/test_fedbn.py::test_fedbn_is_pfllib_clientbn_with_the_authors_communication",
        "tests/methods/test_fedbn.py::test_fedbn_batches_on_vmap_as_client_by_client",
    ),
    differences=(
        "The server weights the uploads by training-set size, as PFLlib's FedBN. The authors' code "
        "weights every client equally; their clients hold equal shares of each domain, so both agree there.",
        "A batch-norm layer is known by its running statistics, the authors' and PFLlib's by `bn` in "
        "the parameter's name; on FedBN's digit CNN (`fedbn_cnn`) both pick the same five layers.",
        "FedBN needs a model with batch norm: `fedbn_cnn` (FedBN's digit CNN), `fedavg_cnn_bn` (the "
        "4-layer CNN with batch norm after every layer but the classifier, FedBN's recipe), `resnet18` or "
        "`mobilenet_v2`; any other model is refused before the run starts.",
    ),
    ala_initialises="the complete units among the downloaded ones (a unit that holds a batch-norm layer is "
    "not downloaded whole, so on `fedbn_cnn` ALA blends the classifier `fc3`)",
)

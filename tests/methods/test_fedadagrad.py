"""FedAdagrad: by default Reddi et al.'s Algorithm 2 by hand; with Flower's options (no momentum, v
from zero), my transcription of Flower 1.41's FedAdagrad (``flwr/serverapp/strategy/fedadagrad.py``
and ``fedopt.py``; tests/support/references.py), on random uploads and on trained rounds."""

from __future__ import annotations

from tests.support.references import Algorithm2, FlowerFedOpt, server_rounds, trained_rounds

FLOWER_FORM = ("fedadagrad.server_lr=0.1", "fedadagrad.beta1=0.0", 'fedadagrad.initial_v="zero"')


def flower(initial):
    return FlowerFedOpt("adagrad", initial, eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)  # Flower fixes β1 = 0


def test_fedadagrad_by_default_is_algorithm_2():
    server_rounds("fedadagrad", lambda initial: Algorithm2("adagrad", initial, eta=0.1, beta1=0.9, beta2=0.0, tau=1e-3))


def test_fedadagrad_matches_a_transcription_of_flowers_fedadagrad_over_rounds():
    server_rounds("fedadagrad", flower, *FLOWER_FORM)


def test_fedadagrad_trained_rounds_match_flowers_fedadagrad():
    trained_rounds("fedadagrad", flower, *FLOWER_FORM)

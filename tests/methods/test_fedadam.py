"""FedAdam: by default Reddi et al.'s Algorithm 2 by hand; with Flower's options, my transcription of
Flower 1.41's FedAdam (``flwr/serverapp/strategy/fedadam.py`` and ``fedopt.py``; tests/support/
references.py), on random uploads and on trained rounds."""

from __future__ import annotations

from tests.support.references import Algorithm2, FlowerFedOpt, server_rounds, trained_rounds

FLOWER_FORM = ("fedadam.server_lr=0.1", "fedadam.bias_correction=true", 'fedadam.initial_v="zero"')


def flower(initial):
    return FlowerFedOpt("adam", initial, eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)


def test_fedadam_by_default_is_algorithm_2():
    server_rounds("fedadam", lambda initial: Algorithm2("adam", initial, eta=0.01, beta1=0.9, beta2=0.99, tau=1e-3))


def test_fedadam_matches_a_transcription_of_flowers_fedadam_over_rounds():
    server_rounds("fedadam", flower, *FLOWER_FORM)


def test_fedadam_trained_rounds_match_flowers_fedadam():
    trained_rounds("fedadam", flower, *FLOWER_FORM)

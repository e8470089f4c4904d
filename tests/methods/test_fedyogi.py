"""FedYogi: by default Reddi et al.'s Algorithm 2 by hand; with Flower's options, my transcription of
Flower 1.41's FedYogi (``flwr/serverapp/strategy/fedyogi.py`` and ``fedopt.py``; tests/support/
references.py), on random uploads and on trained rounds."""

from __future__ import annotations

from tests.support.references import Algorithm2, FlowerFedOpt, server_rounds, trained_rounds

FLOWER_FORM = ("fedyogi.server_lr=0.01", 'fedyogi.initial_v="zero"')


def flower(initial):
    return FlowerFedOpt("yogi", initial, eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3)


def test_fedyogi_by_default_is_algorithm_2():
    server_rounds("fedyogi", lambda initial: Algorithm2("yogi", initial, eta=0.01, beta1=0.9, beta2=0.99, tau=1e-3))


def test_fedyogi_matches_a_transcription_of_flowers_fedyogi_over_rounds():
    server_rounds("fedyogi", flower, *FLOWER_FORM)


def test_fedyogi_trained_rounds_match_flowers_fedyogi():
    trained_rounds("fedyogi", flower, *FLOWER_FORM)

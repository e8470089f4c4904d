"""Clients that never train (``[run] unseen_clients``): scored as newcomers at every evaluation.

The unseen clients are never sampled for training, their data never enters an upload, and
``prepare`` sees only the participants' summaries. At each evaluated round (the final one too)
each unseen client receives what the method gives a newcomer: ``newcomer_state(initial model,
payload)`` (by default ``init_client``) and ``local_init(downlink(server, client, round))``, the
path of a participant's first round. It then fine-tunes the model the method scores
(``eval_params``) for ``unseen_finetune_epochs`` epochs, or ``unseen_finetune_steps`` batches, of
cross-entropy SGD on its training split (the run's train settings, at ``unseen_finetune_lr`` where
given; 0 epochs: none) and the
fine-tuned model is scored on its test split. The state is discarded afterwards: every evaluation
starts the newcomers afresh from the server state of that round, so the numbers depend only on
the seed and the server state (resumed runs and every engine agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..algorithms.base import Algorithm, State
from ..engines.base import ClientJob, ClientResult
from ..functional import Params

#: the prefix of the newcomers' metrics in a round's record
PREFIX = "unseen_"


@dataclass(frozen=True)
class Newcomers:
    """The unseen clients of a run and their fine-tuning budget. ``init``: the initial model their
    states start from (None where the clients build their own states: Flower's server side)."""

    ids: tuple[int, ...]
    finetune_epochs: int = 0
    init: Params | None = None
    finetune_steps: int | None = None
    finetune_lr: float | None = None

    def jobs(self, algorithm: Algorithm, server: State, round: int) -> list[ClientJob]:
        """The evaluation-only jobs of the unseen clients at training round ``round`` (or the final pass)."""
        jobs = []
        for cid in self.ids:
            payload = algorithm.downlink(server, cid, round)
            load = None if self.init is None else partial(algorithm.newcomer_state, self.init, payload, cid)
            jobs.append(
                ClientJob(
                    cid,
                    payload,
                    None,
                    True,
                    False,
                    load=load,
                    finetune=self.finetune_epochs,
                    finetune_steps=self.finetune_steps,
                    finetune_lr=self.finetune_lr,
                )
            )
        return jobs


def participants(num_clients: int, unseen: Sequence[int]) -> list[int]:
    """The clients that train: every client but the unseen ones."""
    excluded = set(unseen)
    return [c for c in range(num_clients) if c not in excluded]


def newcomer_metrics(results: Sequence[ClientResult]) -> dict[str, Any]:
    """The unseen clients' pooled accuracy, mean and std of their accuracies, loss and count
    (``unseen_accuracy``, ``unseen_mean_client_accuracy``, ``unseen_std_client_accuracy``,
    ``unseen_loss``, ``unseen_evaluated_clients``) and their per-client accuracies
    (``unseen_client_accuracy``)."""
    from .driver import evaluation_metrics  # the driver imports this module

    scored = evaluation_metrics(results)
    names = {"test_loss": "loss"}
    return {PREFIX + names.get(k, k): v for k, v in scored.items()}

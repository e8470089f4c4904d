"""The global model on the global test set (the official test-set protocol of
docs/explanations/metrics.md), and the adaptability metrics of every trained local model (FedACD
Tables 3 and 9)."""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..functional import Ensemble, forward, prediction_logits
from ..functional.training import in_row_chunks, probability_matrix, probability_sums, template_kl


class GlobalEvaluation:
    """Accuracy, loss and per-class accuracy of a global model on the global test set, and its
    accuracy on every client's distribution: Acc_m = sum_c pi^m_c acc_c (FedACD Table 2, a
    reconstruction), averaged over the clients (``priors`` [N, C], each client's training label
    distribution)."""

    def __init__(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        num_classes: int,
        priors: np.ndarray,
        batch_size: int = 1000,
        workers: int = 1,
    ) -> None:
        """``workers``: threads that evaluate the test batches concurrently (it runs while no client
        trains, so the parallel engine passes its own count). Each batch runs with the caller's
        intra-op thread count and the batches' sums are added in batch order, so the numbers do not
        depend on ``workers``."""
        self.model, self.x, self.y = model, x, y
        self.workers = max(1, workers)
        self.num_classes = num_classes
        self.priors = np.asarray(priors, dtype=np.float64)
        self.batch_size = batch_size
        self.class_counts = np.bincount(y.cpu().numpy(), minlength=num_classes)
        self._local = threading.local()

    def __call__(self, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        start = time.perf_counter()
        batches = range(0, len(self.y), self.batch_size)
        if self.workers == 1 or len(batches) == 1:
            parts = [self._batch(self.model, params, i) for i in batches]
        else:
            threads = torch.get_num_threads()
            with ThreadPoolExecutor(self.workers, thread_name_prefix="pflkit-eval") as pool:
                parts = list(pool.map(lambda i: self._batch(self._thread_model(threads), params, i), batches))
        hits = np.sum([correct for correct, _ in parts], axis=0)
        loss = math.fsum(loss for _, loss in parts)
        with np.errstate(invalid="ignore", divide="ignore"):
            per_class = np.where(self.class_counts > 0, hits / self.class_counts, np.nan)
        return {
            "global_accuracy": float(hits.sum() / len(self.y)),
            "global_test_loss": loss / len(self.y),
            "global_class_accuracy": [float(a) for a in per_class],
            "global_client_accuracy": float(np.mean(client_accuracies(self.priors, per_class))),
            "global_eval_seconds": time.perf_counter() - start,
        }

    def _thread_model(self, threads: int) -> nn.Module:
        """This thread's copy of the model (``functional_call`` swaps a module's parameters, so
        threads must not share one), with the caller's intra-op thread count."""
        if getattr(self._local, "model", None) is None:
            pure = hasattr(self.model, "apply_units")  # pflkit's models never touch their parameters
            self._local.model = self.model if pure else copy.deepcopy(self.model)
        torch.set_num_threads(threads)
        return self._local.model

    @torch.no_grad()
    def _batch(self, model: nn.Module, params: Mapping[str, torch.Tensor], i: int) -> tuple[np.ndarray, float]:
        """Per-class correct counts and the summed loss of test batch ``i``."""
        inputs = self.x[i : i + self.batch_size]
        logits = in_row_chunks(lambda rows: forward(model, params, rows, train=False), inputs)
        target = self.y[i : i + self.batch_size]
        correct = torch.bincount(target[logits.argmax(1) == target], minlength=self.num_classes)
        return correct.cpu().numpy(), float(F.cross_entropy(logits, target, reduction="sum"))

    def local_risk(self, class_correct: list[float]) -> float:
        """A local model's risk over the clients' distributions (FedACD Eq. 2, a reconstruction): the
        mean over clients of sum_c pi^m_c * error_c, from its per-class correct counts."""
        with np.errstate(invalid="ignore", divide="ignore"):
            accuracy = np.where(self.class_counts > 0, np.asarray(class_correct) / self.class_counts, np.nan)
        return float(1.0 - np.mean(client_accuracies(self.priors, accuracy)))


def client_accuracies(priors: np.ndarray, class_accuracy: np.ndarray) -> np.ndarray:
    """sum_c pi^m_c acc_c per client; classes the test set lacks drop out (priors renormalised)."""
    known = ~np.isnan(class_accuracy)
    weights = priors[:, known]
    weights = weights / np.maximum(weights.sum(1, keepdims=True), 1e-12)
    return weights @ class_accuracy[known]


class AdaptabilityMetrics:
    """A trained local model's per-class correct predictions on the global test set (the driver
    turns them into its risk over the clients' distributions, FedACD Table 3) and KL(P^m || T) of
    its probability matrix over the client's training data against the template with ``gamma``
    (FedACD Table 9): a ``LocalModelMetric`` of the engines."""

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    @torch.no_grad()
    def __call__(self, setup: Any, client_id: int, params: Mapping[str, torch.Tensor] | Ensemble) -> dict[str, Any]:
        test = setup.data.global_test
        if test is None:
            raise ValueError('metrics.adaptability needs the global test set (test_set = "official")')
        C, client, rows = setup.data.num_classes, setup.data.client(client_id), setup.train.eval_batch_size
        correct = torch.zeros(C, device=test[1].device)
        for i in range(0, len(test[1]), rows):
            x, y = test[0][i : i + rows], test[1][i : i + rows]
            correct.index_add_(0, y, (prediction_logits(setup.model, params, x).argmax(1) == y).to(correct.dtype))
        sums = probability_sums(setup.model, params, client.train_x, client.train_y, C, rows)
        counts = torch.bincount(client.train_y, minlength=C)
        kl = template_kl(probability_matrix(sums, counts), counts, self.gamma)
        return {"class_correct": correct.tolist(), "local_kl": float(kl)}


def local_model_metrics(metrics: Any) -> tuple[AdaptabilityMetrics, ...]:
    """The local-model metrics a config's ``[metrics]`` section asks for."""
    return (AdaptabilityMetrics(metrics.template_gamma),) if metrics.adaptability else ()

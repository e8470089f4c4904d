"""The global model on the global test set (the official test-set protocol, spec §5.7, §3.13)."""

from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..functional import forward


class GlobalEvaluation:
    """Accuracy, loss and per-class accuracy of a global model on the global test set, and its
    accuracy on every client's distribution: Acc_m = sum_c pi^m_c acc_c (FedACD Table 2 [RECON]),
    averaged over the clients (``priors`` [N, C], each client's training label distribution)."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                 priors: np.ndarray, batch_size: int = 1000, threads: int | None = None) -> None:
        """``threads``: torch threads for the evaluation, which runs while no client trains (the
        parallel engine's workers are idle then); None keeps the current setting."""
        self.model, self.x, self.y = model, x, y
        self.threads = threads
        self.num_classes = num_classes
        self.priors = np.asarray(priors, dtype=np.float64)
        self.batch_size = batch_size
        self.class_counts = np.bincount(y.cpu().numpy(), minlength=num_classes)

    def __call__(self, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        previous = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            return self._evaluate(params)
        finally:
            torch.set_num_threads(previous)

    @torch.no_grad()
    def _evaluate(self, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        start = time.perf_counter()
        correct = torch.zeros(self.num_classes, device=self.y.device)
        loss = 0.0
        for i in range(0, len(self.y), self.batch_size):
            logits = forward(self.model, params, self.x[i:i + self.batch_size], train=False)
            target = self.y[i:i + self.batch_size]
            correct.index_add_(0, target, (logits.argmax(1) == target).to(correct.dtype))
            loss += float(F.cross_entropy(logits, target, reduction="sum"))
        hits = correct.cpu().numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            per_class = np.where(self.class_counts > 0, hits / self.class_counts, np.nan)
        return {"global_accuracy": float(hits.sum() / len(self.y)),
                "global_test_loss": loss / len(self.y),
                "global_class_accuracy": [float(a) for a in per_class],
                "global_client_accuracy": float(np.mean(client_accuracies(self.priors, per_class))),
                "global_eval_seconds": time.perf_counter() - start}

    def local_risk(self, class_correct: list[float]) -> float:
        """A local model's risk over the clients' distributions (FedACD Eq. 2 [RECON]): the mean
        over clients of sum_c pi^m_c * error_c, from its per-class correct counts."""
        with np.errstate(invalid="ignore", divide="ignore"):
            accuracy = np.where(self.class_counts > 0, np.asarray(class_correct) / self.class_counts, np.nan)
        return float(1.0 - np.mean(client_accuracies(self.priors, accuracy)))


def client_accuracies(priors: np.ndarray, class_accuracy: np.ndarray) -> np.ndarray:
    """sum_c pi^m_c acc_c per client; classes the test set lacks drop out (priors renormalised)."""
    known = ~np.isnan(class_accuracy)
    weights = priors[:, known]
    weights = weights / np.maximum(weights.sum(1, keepdims=True), 1e-12)
    return weights @ class_accuracy[known]

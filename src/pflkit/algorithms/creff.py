"""CReFF (Shang et al., IJCAI 2022): classifier re-training with federated features for
heterogeneous and long-tailed data (spec §3.14; details from the CReFF paper).

Clients train as in FedAvg and also upload, per class they hold, the mean gradient of the
classifier (the linear head) on their real features under the received global model (closed
form: (softmax - onehot) x h). The server averages the models (FedAvg) and keeps ``features``
learnable federated features per class (N(0, 1) at the start, kept across rounds): for
``match_steps`` steps it moves them (SGD, ``feature_lr``) so that the classifier gradient on each
class's features matches the clients' aggregated gradient of that class (cosine distance); then
it re-trains a copy of the averaged classifier on all federated features (``retrain_steps`` full
batch steps at ``retrain_lr``). The re-trained classifier serves the global model's predictions;
clients keep receiving the averaged model unless ``send_retrained``.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch.nn import functional as F

from ..functional import Params, weighted_average
from ..functional.training import Net, one_hot
from ..models import head_names
from .base import Algorithm, ClientContext, ClientSummary, Payload, SentUpload, Settings, State, Trained
from .registry import register


class CReFFSettings(Settings):
    features: int = Field(100, ge=1, description="federated features per class (CReFF: 100)")
    match_steps: int = Field(100, ge=0, description="gradient-matching steps per round (CReFF: 100) [UNCERTAIN]")
    feature_lr: float = Field(0.1, gt=0, description="learning rate of the federated features [UNCERTAIN]")
    retrain_steps: int = Field(300, ge=0, description="classifier re-training steps per round (CReFF: 300) "
                               "[UNCERTAIN]")
    retrain_lr: float = Field(0.01, gt=0, description="classifier re-training learning rate [UNCERTAIN]")
    send_retrained: bool = Field(False, description="send the re-trained classifier to the clients too")


def head_gradients(weight: str, bias: str, body: int) -> Any:
    """Per sample, the cross-entropy gradient of a linear head: [(p - e_y) h^T, p - e_y] flattened."""
    def fn(net: Net, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = net(params, x, stop=body, train=False).flatten(1)
        err = torch.softmax(F.linear(h, params[weight], params[bias]), dim=-1) - one_hot(y, params[weight].shape[0])
        return torch.cat([(err[:, :, None] * h[:, None, :]).flatten(1), err], dim=1)
    return fn


def classifier_gradient(features: torch.Tensor, label: int, weight: torch.Tensor, bias: torch.Tensor,
                        create_graph: bool = False) -> torch.Tensor:
    """The mean cross-entropy gradient of the classifier (weight, bias) on ``features`` of one class,
    flattened as ``head_gradients``."""
    err = torch.softmax(F.linear(features, weight, bias), dim=-1) - one_hot(
        torch.full((len(features),), label, device=features.device), weight.shape[0])
    return torch.cat([(err.t() @ features).flatten() / len(features), err.mean(0)])


@register
class CReFF(Algorithm):
    name = "creff"
    settings_class = CReFFSettings
    settings: CReFFSettings

    def __init__(self, settings: Any, train: Any, units: Any) -> None:
        super().__init__(settings, train, units)
        self.weight, self.bias = head_names(units)[:2]
        self.body = len(units) - 1

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        weight = server["global"][self.weight]
        g = torch.Generator().manual_seed(0)
        features = torch.randn(weight.shape[0], self.settings.features, weight.shape[1], generator=g)
        return {**server, "features": features.to(weight), "head": {self.weight: weight, self.bias:
                                                                     server["global"][self.bias]}}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        received = state["model"]
        sums = ctx.class_sums(received, head_gradients(self.weight, self.bias, self.body))
        counts = ctx.label_counts
        fit = self.train_model(received, ctx, self.loss())
        means = sums / counts.clamp(min=1).to(sums.dtype)[..., None]
        upload = self.upload(fit.params, ctx, class_grads=means, class_counts=counts.to(sums.dtype))
        return {**state, "model": fit.params}, upload, {"train_loss": fit.loss}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        cfg = self.settings
        merged = weighted_average([u["params"] for u in uploads], [u["num_samples"] for u in uploads])
        glob = {**server["global"], **merged}
        counts = torch.stack([u["class_counts"] for u in uploads])  # type: ignore[typeddict-item]
        grads = torch.stack([u["class_grads"] for u in uploads])  # type: ignore[typeddict-item]
        present = counts.sum(0) > 0
        target = (counts[..., None] * grads).sum(0) / counts.sum(0).clamp(min=1)[:, None]
        weight, bias = glob[self.weight].detach(), glob[self.bias].detach()
        features = server["features"].clone().requires_grad_(True)
        classes = torch.nonzero(present).flatten().tolist()
        opt = torch.optim.SGD([features], lr=cfg.feature_lr)
        for _ in range(cfg.match_steps if classes else 0):
            loss = sum(1 - F.cosine_similarity(classifier_gradient(features[c], c, weight, bias), target[c], dim=0)
                       for c in classes)
            opt.zero_grad()
            loss.backward()  # type: ignore[union-attr]
            opt.step()
        features = features.detach()
        head = self.retrain(features, weight, bias)
        return {**server, "global": glob, "features": features, "head": head}

    def retrain(self, features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> Params:
        """A copy of the averaged classifier trained on all federated features (full batch)."""
        C, m, d = features.shape
        x = features.reshape(C * m, d)
        y = torch.arange(C, device=x.device).repeat_interleave(m)
        w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
        opt = torch.optim.SGD([w, b], lr=self.settings.retrain_lr)
        for _ in range(self.settings.retrain_steps):
            loss = F.cross_entropy(F.linear(x, w, b), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return {self.weight: w.detach(), self.bias: b.detach()}

    def global_params(self, server: State) -> Params:
        """The averaged model with the re-trained classifier (the global model CReFF evaluates)."""
        return {**server["global"], **server.get("head", {})}

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        payload = super().downlink(server, client_id, round)
        if self.settings.send_retrained and "head" in server:
            payload = {"global": {**payload["global"], **server["head"]}}
        return payload

"""FedFomo (Zhang et al., ICLR 2021): first-order model optimisation over other clients' models
(spec §2.10).

The server keeps every client's latest model and an affinity matrix P (identity at start) and
sends client i the models of the M others with the largest P_i. The client weighs each received
theta_n by its first-order benefit on a validation split (the last ``val_ratio`` of its training
data; training uses the rest):
w_n = max(0, (L_val(theta_old) - L_val(theta_n)) / (||theta_n - theta_old|| + 1e-5)) and moves to
theta_old + sum_n w_n / sum_m w_m (theta_n - theta_old) (kept when all w_n = 0); then E epochs of
SGD; it uploads its model and w, which the server adds to P_i. Evaluated model: the combined
theta_i. No ALA: several models are downloaded. The paper's epsilon-greedy exploration is not
implemented (it is irrelevant with M = N, the FedALA setting).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from pydantic import Field

from ..data.federated import ClientData
from ..functional import Params, evaluate
from .base import Algorithm, ClientContext, ClientSummary, Payload, Settings, State, Upload
from .registry import register


class FedFomoSettings(Settings):
    num_models: int | None = Field(None, ge=1, description="M, models sent to each client (None = all other "
                                   "clients, the FedALA setting M = N)")
    val_ratio: float = Field(0.2, gt=0, lt=1, description="share of the training data held out for the "
                             "model weights [REF-CODE, spec §2.10]")


def split_validation(data: ClientData, val_ratio: float) -> tuple[ClientData, ClientData]:
    """(training part, validation part): the last ``val_ratio`` of the training samples validate.

    A client with a single training sample validates on it and trains on it.
    """
    n = data.num_train
    if n < 2:
        return data, data
    n_val = min(n - 1, max(1, int(n * val_ratio)))
    cut = n - n_val

    def part(sl: slice) -> ClientData:
        rows = data.train_rows[sl] if data.train_rows is not None else None
        return replace(data, train_x=data.train_x[sl], train_y=data.train_y[sl], train_rows=rows)

    return part(slice(0, cut)), part(slice(cut, n))


@register
class FedFomo(Algorithm):
    name = "fedfomo"
    settings_class = FedFomoSettings
    settings: FedFomoSettings
    ala_targets = {}
    supports_batching = False

    def prepare(self, server: State, clients: list[ClientSummary]) -> State:
        n = max(c.client_id for c in clients) + 1
        return {**server, "models": {c.client_id: server["global"] for c in clients},
                "affinity": torch.eye(n, dtype=torch.float64)}

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        others = [j for j in server["models"] if j != client_id]
        scores = server["affinity"][client_id]
        chosen = sorted(others, key=lambda j: (-float(scores[j]), j))[:self.settings.num_models or len(others)]
        return {"models": [server["models"][j] for j in chosen], "ids": torch.tensor(chosen, dtype=torch.long)}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        _, val = split_validation(ctx.data, self.settings.val_ratio)
        old = state["model"]
        names = [n for _, members in self.units for n in members]

        def val_loss(params: Params) -> float:
            result = evaluate(ctx.model, params, val.train_x, val.train_y, self.train.eval_batch_size)
            return result["loss_sum"] / result["num_samples"]

        base_loss = val_loss(old)
        weights = torch.zeros(len(payload["models"]), dtype=torch.float64)
        for m, theta in enumerate(payload["models"]):
            distance = float(torch.sqrt(sum(torch.sum((theta[k] - old[k]) ** 2) for k in names)))
            weights[m] = max(0.0, (base_loss - val_loss(theta)) / (distance + 1e-5))
        total = float(weights.sum())
        model = dict(old)
        if total > 0:
            model = {k: old[k] + sum(float(w) / total * (theta[k] - old[k])
                                     for w, theta in zip(weights, payload["models"]) if w > 0)
                     for k in old}
        ctx.info["fomo_models_used"] = int((weights > 0).sum())
        return {**state, "model": model, "weights": weights}

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        affinity = server["affinity"].clone()
        for u in uploads:
            affinity[u["client_id"], u["ids"]] += u["weights"]
        return {**self.keep_latest_models(server, uploads), "affinity": affinity}

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        train, _ = split_validation(ctx.data, self.settings.val_ratio)
        params, loss = replace(ctx, data=train).sgd(state["model"], epochs=self.train.local_epochs)
        upload = self.upload(params, ctx, weights=state["weights"], ids=payload["ids"])
        return {**state, "model": params}, upload, {"train_loss": loss}

"""FedFomo (Zhang et al., ICLR 2021): first-order model optimisation over other clients' models
(a baseline of the FedALA paper).

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

from typing import cast

import torch
from pydantic import Field

from ..functional import Params, evaluate
from .base import Algorithm, ClientContext, ClientSummary, Init, Payload, SentUpload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .context import PER_CLIENT, TrainBatches
from .registry import register


class FedFomoSettings(Settings):
    num_models: int | None = Field(
        None, ge=1, description="M, models sent to each client (None = all other clients, the FedALA setting M = N)"
    )
    val_ratio: float = Field(
        0.2, gt=0, lt=1, description="share of the training data held out for the model weights (the reference code's)"
    )


@register
class FedFomo(Algorithm):
    name = "fedfomo"
    settings_class = FedFomoSettings
    settings: FedFomoSettings
    ala_targets = {}
    newcomer_refusal = "fedfomo chooses the models it sends a client by that client's affinities on the server"
    needs = frozenset({PER_CLIENT})  # weighs each downloaded model by a Python loop over its validation loss

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        n = max(c.client_id for c in clients) + 1
        return {
            **server,
            "models": {c.client_id: server["global"] for c in clients},
            "affinity": torch.eye(n, dtype=torch.float64),
        }

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        others = [j for j in server["models"] if j != client_id]
        scores = server["affinity"][client_id]
        chosen = sorted(others, key=lambda j: (-float(scores[j]), j))[: self.settings.num_models or len(others)]
        return {"models": [server["models"][j] for j in chosen], "ids": torch.tensor(chosen, dtype=torch.long)}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        validation = ctx.holdout(self.settings.val_ratio)  # what local training leaves out
        old = state["model"]
        names = self.parameter_names

        def val_loss(params: Params) -> float:
            result = evaluate(ctx.model, params, validation.x, validation.y, self.train.eval_batch_size)
            return result["loss_sum"] / result["num_samples"]

        base_loss = val_loss(old)
        weights = torch.zeros(len(payload["models"]), dtype=torch.float64)
        for m, theta in enumerate(payload["models"]):
            distance = float(torch.sqrt(cast(torch.Tensor, sum(torch.sum((theta[k] - old[k]) ** 2) for k in names))))
            weights[m] = max(0.0, (base_loss - val_loss(theta)) / (distance + 1e-5))
        total = float(weights.sum())
        model = dict(old)
        if total > 0:
            model = {
                k: old[k]
                + sum(float(w) / total * (theta[k] - old[k]) for w, theta in zip(weights, payload["models"]) if w > 0)
                for k in old
            }
        return {**state, "model": model, "weights": weights}, {"fomo_models_used": int((weights > 0).sum())}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        affinity = server["affinity"].clone()
        for u in uploads:
            # the ignore: uploads are SentUpload to mypy, ids/weights are FedFomo's own keys
            affinity[u["client_id"], u["ids"]] += u["weights"]  # type: ignore[typeddict-item]
        return {**self.keep_latest_models(server, uploads), "affinity": affinity}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        data = TrainBatches("train", self.train.local_epochs, holdout=self.settings.val_ratio)
        fit = ctx.fit(state["model"], self.loss(), data=data)
        upload = self.upload(fit.params, ctx, weights=state["weights"], ids=payload["ids"])
        return {**state, "model": fit.params}, upload, {"train_loss": fit.loss}


FedFomo.card = MethodCard(
    full_name="FedFomo",
    paper=Paper(
        "Personalized Federated Learning with First Order Model Optimization",
        "Zhang et al.",
        2021,
        "ICLR",
        "https://arxiv.org/abs/2012.08565",
    ),
    personalised=True,
    shares="Its model and its weights for the others' models; the server keeps every client's latest "
    "model and adds the weights to an affinity matrix.",
    keeps="Its combined model.",
    scored="the combined model",
    client_round="Receive the other clients' models. Weigh each by its validation-loss gain per distance "
    "on the last 20 % of the training data. Move to the weighted combination. Train on the other 80 %. "
    "Upload the model and the weights.",
    references=(Reference("TsingZ0/PFLlib", "f1e313a", ("clients/clientfomo.py", "servers/serverfomo.py")),),
    tests=(
        "tests/methods/test_fedfomo.py::"
        "test_fedfomo_weights_combination_and_training_match_pfllib_for_the_same_base_and_candidates",
    ),
    pinned=(
        "tests/methods/test_fedfomo.py::test_fedfomo_two_rounds_combine_as_pfllib",
        "tests/methods/test_fedfomo.py::test_fedfomo_evaluated_model_is_pfllibs",
        "tests/methods/test_fedfomo.py::test_fedfomo_affinity_accumulates_raw_weights_as_pfllib",
    ),
    differences=(
        "Given one base model and one set of candidates, the weights, combination and training agree.",
        "PFLlib's base is the client's previous combined model, and its own trained model is a candidate. "
        "pflkit's base is its trained model, and the candidates are the other clients' models.",
        "PFLlib scores last round's trained model; pflkit scores the combined one.",
        "PFLlib's affinity adds raw (also negative) weights; pflkit adds clipped ones. This matters only "
        "for `num_models` < N.",
        "Validation loss: PFLlib takes the mean of batch means, pflkit the sample mean.",
    ),
    choices=(
        Choice(
            "ε-greedy model selection", "not implemented (irrelevant with M = N)", "`num_models` (top M by affinity)"
        ),
    ),
)

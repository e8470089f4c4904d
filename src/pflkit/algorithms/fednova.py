"""FedNova (Wang et al., NeurIPS 2020): normalised averaging against objective inconsistency
(a baseline of the FedACD paper).

Client m runs tau_m local SGD steps and uploads its normalised update d_m = (w^{t-1} - w_m) / a_m,
with a_m = tau_m for plain SGD and a_m = sum_{k<tau_m} (1 - rho^{k+1}) / (1 - rho) with momentum
rho. Server: w^t = w^{t-1} - tau_eff * sum_m p_m d_m, tau_eff = sum_m p_m a_m, p_m = n_m / sum n
over the round's clients. Batch-norm statistics are averaged as in FedAvg.
"""

from __future__ import annotations

import torch

from ..functional import scale, weighted_average
from .base import Algorithm, ClientContext, Payload, SentUpload, State, Trained
from .card import MethodCard, Paper, Reference
from .registry import register


def normaliser(steps: torch.Tensor | int, momentum: float) -> torch.Tensor:
    """a = sum_{k=0}^{tau-1} (1 - rho^{k+1}) / (1 - rho) (= tau without momentum), per client."""
    tau = torch.as_tensor(steps, dtype=torch.float64)
    if not momentum:
        return tau
    rho = momentum
    return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)


@register
class FedNova(Algorithm):
    name = "fednova"

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        start = {**state["model"]}
        fit = self.train_model(start, ctx, self.loss())
        a = normaliser(fit.steps, self.train.momentum)
        names = set(self.parameter_names)
        inverse = 1.0 / a.clamp(min=1.0)  # a client without a step uploads no change
        update = {k: scale(inverse, start[k] - fit.params[k]) if k in names else fit.params[k] for k in fit.params}
        upload = self.upload(update, ctx, normaliser=a.to(next(iter(update.values())).device))
        return {**state, "model": fit.params}, upload, {"train_loss": fit.loss, "local_steps": fit.steps}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        n = torch.tensor([float(u["num_samples"]) for u in uploads], dtype=torch.float64)
        p = n / n.sum()
        # the ignore: uploads are SentUpload to mypy, normaliser is FedNova's own key
        a = torch.tensor([float(u["normaliser"]) for u in uploads], dtype=torch.float64)  # type: ignore[typeddict-item]
        tau_eff = float((p * a).sum())
        names = set(self.parameter_names)
        direction = weighted_average([u["params"] for u in uploads], p.tolist())
        old = server["global"]
        new = {k: (old[k] - tau_eff * v if k in names else v) for k, v in direction.items()}
        return {**server, "global": {**old, **new}}


FedNova.card = MethodCard(
    full_name="FedNova",
    paper=Paper(
        "Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization",
        "Wang et al.",
        2020,
        "NeurIPS",
        "https://arxiv.org/abs/2007.07481",
    ),
    personalised=False,
    shares="Its normalised update d_m and its normaliser a_m.",
    keeps="Nothing between rounds.",
    scored="the received global",
    client_round="Overwrite the local model with the received global. Run τ_m SGD steps. Upload "
    "d_m = (w^{t−1} − w_m)/a_m (a_m = τ_m, or the momentum normaliser). The server steps "
    "w − τ_eff Σ p_m d_m.",
    references=(Reference("JYWa/FedNova", "47b4e09", ("distoptim/FedNova.py (step, average)", "train_LocalSGD.py")),),
    tests=("tests/methods/test_fednova.py::test_fednova_matches_the_authors_optimizer_and_average",),
    differences=(
        "The test runs momentum 0 and 0.9.",
        "Their script hard-codes weight decay 1e-4; pflkit uses the run's.",
        "Their server momentum `gmf` and their FedProx variant are not in pflkit.",
        "Their p_i is over all workers (equal under full participation).",
        "Their average touches the optimiser's parameters only, so batch-norm statistics stay per worker; "
        'pflkit averages them, and with the default `bn_buffers = "local"` each client keeps its own on '
        "download (the same as theirs).",
        "Their script divides the lr by 10 at half the rounds and by 100 at three quarters; pflkit has no "
        "step schedule (`lr_decay` is exponential).",
    ),
)

"""FedALA and the ``X+ala`` methods: ALA as a method replaces only the local initialisation, its
start round and freezing, its weight plot, and FedAvg + ALA against my transcription of the
reference: TsingZ0/FedALA a7a9b21 ``system/utils/ALA.py`` (last changed in b402ad8: keep the last
partial batch; the threshold is passed in, FedALA's README says the paper used 0.01). ALA's own
maths is in tests/personalize/test_ala.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from pflkit.methods import build_algorithm
from pflkit.models import reference_layer_idx, top_unit_names
from tests.support.builders import build, client_ctx, params_of, perturbed, tiny_context
from tests.support.checks import ATOL, RTOL, assert_params_close
from tests.support.references import module_at, weights


def test_with_ala_replaces_only_local_init_for_fedprox_and_ditto_targets():
    from pflkit.config import load_config

    ctx = tiny_context(n_train=30)
    cfg = load_config(None, ["fedala.max_start_epochs=2"])
    local, glob = params_of(ctx, 1), params_of(ctx, 2)
    for name, key in [("fedprox+ala", "model"), ("ditto+ala", "model")]:
        alg = build_algorithm(name, cfg.algorithm_sections(), ctx.train, ctx.units)
        state = alg.init_client(local, 0)
        state, _ = alg.local_init({"global": glob}, state, ctx)
        assert state["ala"]["started"]
        assert not all(torch.equal(state[key][k], glob[k]) for k in glob)
    cfg = load_config(None, ["fedala.max_start_epochs=2", "ditto.ala_target='personal'"])
    alg = build_algorithm("ditto+ala", cfg.algorithm_sections(), ctx.train, ctx.units)
    state = alg.init_client(local, 0)
    state["personal"] = params_of(ctx, 3)
    state, _ = alg.local_init({"global": glob}, state, ctx)
    assert all(torch.equal(state["model"][k], glob[k]) for k in glob)  # global track overwritten
    top = top_unit_names(ctx.units, 1)
    assert not all(torch.equal(state["personal"][k], glob[k]) for k in top)  # personal blended


@pytest.mark.integration
def test_start_round_and_freeze_after_start(tmp_path) -> None:
    import json

    from pflkit.config import load_config
    from pflkit.run.experiment import run_experiment

    def rows(*overrides: str) -> list[dict]:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        config = load_config(
            None, ["num_clients=4", "rounds=4", 'algorithms=["fedala"]', "fedala.max_start_epochs=3", *overrides]
        )
        run_experiment(config, out, progress=False, echo=lambda s: None)
        return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train_round" in r]

    late = rows("fedala.start_round=3")
    assert [r["ala_epochs"] for r in late][:2] == [0, 0] and late[2]["ala_epochs"] > 0  # off, off, start phase
    frozen = rows("fedala.freeze_after_start=true")
    assert frozen[1]["ala_epochs"] > 0 and frozen[2]["ala_epochs"] == 0 and frozen[3]["ala_epochs"] == 0
    assert frozen[2]["ala_w_mean.fc"] == frozen[3]["ala_w_mean.fc"] == frozen[1]["ala_w_mean.fc"]  # W reused
    learning = rows()
    assert learning[2]["ala_epochs"] > 0 and learning[2]["ala_w_mean.fc"] != learning[1]["ala_w_mean.fc"]


@pytest.mark.integration
def test_plot_ala_draws_the_weights_and_refuses_runs_without_ala(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from pflkit.cli import main
    from pflkit.config import load_config
    from pflkit.run.experiment import run_experiment

    config = load_config(None, ["num_clients=4", "rounds=2", 'algorithms=["fedavg", "fedala"]'])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    result = CliRunner().invoke(main, ["plot", "ala", str(tmp_path / "run"), "--client", "1"])
    assert result.exit_code == 0 and (tmp_path / "run" / "plots" / "ala.png").is_file()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    start = [r for r in records if r["algorithm"] == "fedala" and "ala_start_losses" in r]
    assert [r["round"] for r in start] == [2]  # the start phase: the first round with a received model
    curve = start[0]["ala_start_losses"]["1"]
    assert len(curve) > 1 and curve[-1] < curve[0]  # weight learning lowers the loss
    config = load_config(None, ["num_clients=4", "rounds=1", 'algorithms=["fedavg"]'])
    run_experiment(config, tmp_path / "plain", progress=False, echo=lambda s: None)
    result = CliRunner().invoke(main, ["plot", "ala", str(tmp_path / "plain")])
    assert result.exit_code == 2 and "has no ALA method" in result.output


# ================================================================ ALA (TsingZ0/FedALA ALA.py)


class ReferenceALA:
    """ALA.adaptive_local_aggregation restated. Skips when sum(global[0] - local[0]) == 0;
    otherwise the local model's lower tensors (all but the last ``layer_idx``) take the global
    values; a deep copy learns W (ones at first, kept between calls) on the sample in order
    (batches of b, the last one partial), each batch: grads of the copy's top tensors,
    W <- clip(W - eta * grad * (global - local), 0, 1), copy's top <- local + (global - local) W;
    one epoch once started, else until more than ``num_pre_loss`` epoch losses (the last batch's)
    have std < threshold; finally the local top tensors take the copy's."""

    def __init__(self, batch_size: int, layer_idx: int, eta: float, threshold: float, num_pre_loss: int) -> None:
        self.b, self.k, self.eta = batch_size, layer_idx, eta
        self.threshold, self.num_pre_loss = threshold, num_pre_loss
        self.weights = None
        self.start_phase = True

    def __call__(self, global_model: torch.nn.Module, local_model: torch.nn.Module, x, y) -> int:
        batches = [(x[i : i + self.b], y[i : i + self.b]) for i in range(0, len(y), self.b)]
        g_params, l_params = list(global_model.parameters()), list(local_model.parameters())
        if torch.sum(g_params[0] - l_params[0]) == 0:
            return 0
        with torch.no_grad():
            for p, g in zip(l_params[: -self.k], g_params[: -self.k]):
                p.copy_(g)
        temp = copy.deepcopy(local_model)
        t_params = list(temp.parameters())
        top_l, top_g, top_t = l_params[-self.k :], g_params[-self.k :], t_params[-self.k :]
        for p in t_params[: -self.k]:
            p.requires_grad_(False)
        if self.weights is None:
            self.weights = [torch.ones_like(p) for p in top_l]
        with torch.no_grad():
            for t, loc, g, w in zip(top_t, top_l, top_g, self.weights):
                t.copy_(loc + (g - loc) * w)
        losses, epochs = [], 0
        while True:
            for bx, by in batches:
                temp.zero_grad()
                loss = F.cross_entropy(temp(bx), by)
                loss.backward()
                with torch.no_grad():
                    self.weights = [
                        torch.clamp(w - self.eta * t.grad * (g - loc), 0, 1)
                        for t, loc, g, w in zip(top_t, top_l, top_g, self.weights)
                    ]
                    for t, loc, g, w in zip(top_t, top_l, top_g, self.weights):
                        t.copy_(loc + (g - loc) * w)
            losses.append(loss.item())
            epochs += 1
            if not self.start_phase:
                break
            if len(losses) > self.num_pre_loss and np.std(losses[-self.num_pre_loss :]) < self.threshold:
                break
        self.start_phase = False
        with torch.no_grad():
            for loc, t in zip(top_l, top_t):
                loc.copy_(t)
        return epochs


@pytest.mark.parametrize(
    "p,fast", [(1, True), (2, True), (1, False)], ids=["p1-closed-form", "p2-cached-features", "p1-plain-autograd"]
)
def test_fedala_matches_ala_py_first_round_idle_then_start_phase_then_one_epoch(p, fast):
    """FedAvg + ALA on three receptions: the global equals the local model (idle), a start phase
    until the loss std converges, then one epoch from the kept W. pflkit's default sample is a
    random subset; ``sampling = "contiguous"`` is ALA.py's slice; ``p`` counts units, ALA.py's
    ``layer_idx`` tensors (``reference_layer_idx``)."""
    model = client_ctx(0).model
    ctxs = {t: client_ctx(0, n_train=30, batch_size=10, round=t, model=model) for t in (1, 2, 3)}
    opts = [
        f"fedala.p={p}",
        "fedala.eta=5.0",
        "fedala.sample_fraction=0.8",
        "fedala.sampling='contiguous'",
        "fedala.threshold=0.003",
        "fedala.num_pre_loss=4",
        "fedala.max_start_epochs=1000",
    ]
    if not fast:
        opts += ["fedala.cache_features=false", "fedala.closed_form_head=false"]
    alg = build("fedavg+ala", ctxs[1], *opts)
    w0 = params_of(ctxs[1], 1)
    ref = ReferenceALA(
        batch_size=10, layer_idx=reference_layer_idx(ctxs[1].units, p), eta=5.0, threshold=0.003, num_pre_loss=4
    )
    state = alg.init_client(w0, 0)
    received = {1: w0, 2: params_of(ctxs[1], 2), 3: params_of(ctxs[1], 3)}
    trained = {1: w0, 2: perturbed(w0, 41, 0.1), 3: perturbed(w0, 42, 0.1)}  # the local model before each
    epochs = []
    for t in (1, 2, 3):
        state = {**state, "model": trained[t]}
        state, info = alg.local_init({"global": received[t]}, state, ctxs[t])
        local = module_at(model, trained[t])
        sample = ctxs[t].sample("ala", 0.8, "contiguous")
        assert len(sample.y) == 24  # batches of 10, 10 and a partial 4
        n = ref(module_at(model, received[t]), local, sample.x, sample.y)
        assert info["ala_epochs"] == n
        epochs.append(n)
        assert_params_close(state["model"], weights(local))
        expected_w = (
            ref.weights if ref.weights is not None else [torch.ones_like(v) for v in state["ala"]["weights"].values()]
        )
        torch.testing.assert_close(list(state["ala"]["weights"].values()), expected_w, rtol=RTOL, atol=ATOL)
    assert epochs[0] == 0 and epochs[1] > 8 and epochs[2] == 1  # the std rule, not the window, ended the start
    w = torch.cat([v.flatten() for v in ref.weights])
    assert (w == 0).any() and (w == 1).any() and ((w > 0) & (w < 1)).any()  # both clip bounds engaged

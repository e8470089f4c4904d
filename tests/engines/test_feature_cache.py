"""fit(start=...): frozen lower units computed once per fit (FedRep's head epochs)
give the numbers of running the whole model at every step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pflkit.algorithms import TrainBatches
from pflkit.config import load_config
from pflkit.engines import LoopEngine, VmapEngine
from pflkit.federation.session import on_engine
from pflkit.functional import classification_loss
from pflkit.methods import build_algorithm
from pflkit.models import head_names
from tests.support.builders import make_data, session_for, setup_for


def fedrep_run(data, cache: bool, engine, extra=()):
    setup, init = setup_for("fedrep", data)
    cfg = load_config(None, ["fedrep.head_epochs=3", f"fedrep.cache_features={str(cache).lower()}", *extra])
    train = setup.train if not extra else cfg.train
    alg = build_algorithm("fedrep", cfg.algorithm_sections(), train, setup.units)
    setup = dataclasses.replace(setup, algorithm=alg, train=train)
    return session_for(setup, init).run(on_engine(engine, setup))


def max_difference(a, b) -> float:
    return max(
        float((a.clients[c]["model"][n] - b.clients[c]["model"][n]).abs().max())
        for c in a.clients
        for n in a.clients[c]["model"]
    )


@pytest.mark.parametrize("engine", [LoopEngine, lambda: VmapEngine(4)], ids=["loop", "vmap"])
def test_fedrep_head_epochs_on_cached_features_match_the_whole_model(engine):
    data = make_data([30, 45, 12, 60, 45])
    cached, whole = fedrep_run(data, True, engine()), fedrep_run(data, False, LoopEngine())
    assert max_difference(cached, whole) < 1e-6  # float reassociation of the body's batched forward only
    assert [r["accuracy"] for r in cached.history] == pytest.approx([r["accuracy"] for r in whole.history])


def test_with_mixup_the_whole_model_runs(tmp_path):
    """Mixup mixes inputs, not features: no cache, the same bits as without asking for one."""
    data = make_data([30, 45, 12])
    a = fedrep_run(data, True, LoopEngine(), ["mixup=true", "batch_size=10", "lr=0.05"])
    b = fedrep_run(data, False, LoopEngine(), ["mixup=true", "batch_size=10", "lr=0.05"])
    assert max_difference(a, b) == 0.0


def test_fit_refuses_to_cache_units_it_trains():
    from pflkit.engines.client import SingleClientContext

    setup, init = setup_for("fedavg", make_data([30]))
    ctx = SingleClientContext(0, 1, 0, setup.data.client(0), setup.model, setup.units, setup.train)
    with pytest.raises(ValueError, match="would train parameters of the units below it"):
        ctx.fit(init, classification_loss, data=TrainBatches(), start=len(setup.units) - 1)
    head = head_names(setup.units)
    fit = ctx.fit(init, classification_loss, trainable=head, data=TrainBatches(), start=len(setup.units) - 1)
    assert all(torch.equal(fit.params[k], init[k]) for k in init if k not in head)

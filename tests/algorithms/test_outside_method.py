"""A method written outside pflkit (docs/examples/mylab_methods.py) runs by dotted path and by entry
point, on every engine, under +ala, in a sweep and on Flower's in-process grid; the registry needs
no import order; every hook a method overrides is honoured under +ala."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pflkit.algorithms import Algorithm, Registry
from pflkit.config import ConfigError, load_config
from pflkit.methods import REGISTRY, build_algorithm
from pflkit.run.experiment import run_experiment
from tests.support.paths import REPO
from tests.support.runs import records

EXAMPLE = REPO / "docs" / "examples" / "mylab_methods.py"
FAST = ["dataset=synthetic", "num_clients=3", "alpha=0.5", "rounds=2", "lr=0.05", "fedala.max_start_epochs=4"]
METHODS = ["mylab_methods:FedPer", "mylab_methods:FedPer+ala"]


@pytest.fixture
def mylab(tmp_path, monkeypatch) -> Path:
    """The example module importable as ``mylab_methods`` (from a folder outside the package)."""
    folder = tmp_path / "lab"
    folder.mkdir()
    shutil.copy(EXAMPLE, folder / "mylab_methods.py")
    monkeypatch.syspath_prepend(str(folder))
    return folder


def assert_close_records(a: list[dict], b: list[dict], rel: float) -> None:
    assert [(r["algorithm"], r["round"]) for r in a] == [(r["algorithm"], r["round"]) for r in b]
    for x, y in zip(a, b):
        for key in ("accuracy", "test_loss", "train_loss"):
            if key in x:
                assert x[key] == pytest.approx(y[key], rel=rel), (x["algorithm"], x["round"], key)


@pytest.mark.integration
def test_an_outside_method_runs_on_every_engine_and_under_ala(mylab, tmp_path):
    runs = {}
    for engine in ("loop", "parallel", "vmap"):
        config = load_config(
            None, FAST + [f"algorithms={json.dumps(METHODS)}", f"engine={engine}", "myfedper.head_units=1"]
        )
        run_experiment(config, tmp_path / engine, progress=False, echo=lambda s: None)
        runs[engine] = records(tmp_path / engine)
    assert {r["algorithm"] for r in runs["loop"]} == set(METHODS)
    for engine in ("parallel", "vmap"):  # ALA's weight learning is batched there: float reassociation
        assert_close_records(runs[engine], runs["loop"], rel=1e-4)
    # FedPer keeps its head: after training, the clients' heads differ and their bodies came from one model
    checkpoint = torch.load(tmp_path / "loop" / "checkpoints" / "mylab_methods:FedPer-seed0.pt", weights_only=True)
    heads = [
        c["model"]["head.weight"] if "head.weight" in c["model"] else list(c["model"].values())[-2]
        for c in checkpoint["clients"].values()
    ]
    assert not torch.equal(heads[0], heads[1])
    # +ala learned weights on the top body unit (the head is personal, so not downloaded)
    summary = json.loads((tmp_path / "loop" / "summary.json").read_text())
    assert summary["mylab_methods:FedPer+ala"]["ala_weights"] > 0


@pytest.mark.integration
def test_an_outside_method_runs_in_a_sweep(mylab, tmp_path):
    from pflkit.run.sweep import run_sweep

    record = run_sweep(
        None,
        FAST + ['algorithms=["mylab_methods:FedPer"]', "myfedper.head_units=[1,2]"],
        tmp_path / "sweep",
        progress=False,
        echo=lambda s: None,
    )
    assert sorted(c["folder"] for c in record["cells"]) == ["myfedper.head_units=1", "myfedper.head_units=2"]
    best = [c["summary"]["mylab_methods:FedPer"]["best_accuracy"] for c in record["cells"]]
    assert best[0] != best[1]  # the section's setting reached the method


@pytest.mark.integration
@pytest.mark.flower
def test_an_outside_method_runs_on_flowers_in_process_grid_as_in_the_simulator(mylab, tmp_path):
    pytest.importorskip("flwr")
    from pflkit.flower.client_app import app as client_app
    from pflkit.flower.local import LocalGrid
    from pflkit.flower.server import run_on_flower

    config = load_config(None, FAST + [f"algorithms={json.dumps(METHODS)}", "engine=loop"])
    grid = LocalGrid(client_app, [{"partition-id": i, "num-partitions": 3} for i in range(3)])
    run_on_flower(config, grid, tmp_path / "flower", wait_seconds=5)
    run_experiment(config, tmp_path / "sim", progress=False, echo=lambda s: None)
    assert_close_records(records(tmp_path / "flower"), records(tmp_path / "sim"), rel=1e-9)


def test_an_installed_entry_point_names_a_method(mylab, monkeypatch):
    info = mylab / "mylab-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mylab\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pflkit.methods]\nfedper_ep = mylab_methods:FedPer\n")
    config = load_config(None, FAST + ['algorithms=["fedper_ep", "fedper_ep+ala"]', "myfedper.head_units=2"])
    assert config.myfedper.head_units == 2
    assert "fedper_ep" in REGISTRY.available()
    alg = build_algorithm(
        "fedper_ep+ala", config.algorithm_sections(), config.train, [("body", ["w"]), ("head", ["h"])]
    )
    assert alg.name == "fedper_ep+ala" and alg.base.settings.head_units == 2


@pytest.mark.parametrize("first", ["pflkit.algorithms", "pflkit.personalize", "pflkit.config", "pflkit.methods"])
def test_the_registry_needs_no_import_order(first):
    """Whatever was imported before, pflkit.methods resolves every name, ``fedala`` included."""
    code = (
        f"import {first}; from pflkit.methods import build_algorithm, available; "
        "from pflkit.algorithms import TrainSettings; "
        "a = build_algorithm('fedala', {}, TrainSettings(), [('conv', ['c.w']), ('fc', ['f.w', 'f.b'])]); "
        "assert type(a).__name__ == 'WithALA' and 'fedprox+ala' in available(), a; "
        "print(len(available()))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert int(out) == len(REGISTRY.available())


@pytest.mark.parametrize(
    "name, message",
    [
        ("nowhere_module:Thing", "module 'nowhere_module' cannot be imported"),
        ("mylab_bad:Missing", "has no 'Missing'"),
        ("mylab_bad:NotAMethod", "is not a subclass of pflkit.algorithms.Algorithm"),
        ("mylab_bad:Nameless", "needs a class attribute name"),
        ("mylab_bad:Clash", "already a section of pflkit's methods"),
        ("mylab_bad", "unknown algorithm 'mylab_bad'"),
    ],
)
def test_bad_method_references_are_named(tmp_path, monkeypatch, name, message):
    (tmp_path / "mylab_bad.py").write_text(
        textwrap.dedent("""
        from pflkit.algorithms import Algorithm


        class NotAMethod:
            name = "not_a_method"


        class Nameless(Algorithm):
            pass


        class Clash(Algorithm):
            name = "fedprox"
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mylab_bad", raising=False)
    with pytest.raises(ConfigError, match=message):
        load_config(None, FAST + [f"algorithms={json.dumps([name])}"])


def test_a_registry_of_ones_own_is_independent_of_pflkits():
    registry = Registry()

    @registry.register
    class Mine(Algorithm):
        name = "mine"

    assert registry.available() == ["mine"] and "mine" not in REGISTRY.available()
    assert registry.resolve("mine").cls is Mine


# ---- every hook a method overrides is honoured under +ala --------------------------------------
def _wrapped(base: Algorithm, cfg) -> Algorithm:
    from pflkit.personalize.ala import AdaptiveLocalAggregation, WithALA

    return WithALA(base, AdaptiveLocalAggregation(cfg.fedala, base.units, cfg.train), f"{base.name}+ala")


def test_every_hook_ala_does_not_change_is_the_bases():
    from pflkit.personalize.ala import WithALA, algorithm_hooks

    called: list[str] = []
    sentinel = object()

    def recording(hook: str):
        if isinstance(vars(Algorithm)[hook], property):
            return property(lambda self: called.append(hook) or sentinel)

        def method(self, *args, **kwargs):
            called.append(hook)
            return sentinel

        return method

    # ala_target is read when ALA is set up (below); every other hook is called through the wrapper
    delegated = [h for h in algorithm_hooks() if h not in WithALA.OWN_HOOKS and h != "ala_target"]
    assert {"head_update", "schedule_rounds", "downloaded_names", "aggregator", "loss"} <= set(delegated)
    Recorder = type("Recorder", (Algorithm,), {"name": "recorder", **{h: recording(h) for h in delegated}})
    cfg = load_config(None, [])
    wrapped = _wrapped(Recorder(Recorder.settings_class(), cfg.train, [("conv", ["c.w"]), ("fc", ["f.w"])]), cfg)
    for hook in delegated:
        value = getattr(wrapped, hook)
        assert (value if isinstance(vars(Algorithm)[hook], property) else value(1, 2, 3)) is sentinel, hook
    assert called == delegated


def test_the_hooks_ala_extends_keep_what_the_base_does():
    from pflkit.algorithms.fedavg import FedAvg
    from tests.support.builders import params_of, tiny_context

    received = []

    class Mine(FedAvg):
        name = "mine"

        def round_metrics(self, client_metrics):
            return {"mine": len(client_metrics)}

        def summary_metrics(self, init_params):
            return {"mine": 2}

        def init_client(self, init_params, client_id):
            return {**super().init_client(init_params, client_id), "extra": torch.ones(1)}

        def receive(self, payload, state, ctx):
            received.append(ctx.round)
            return super().receive(payload, state, ctx)

        def after_receive(self, payload, state, ctx):
            return {**state, "after": torch.zeros(1)}, {"after_receive": torch.tensor(1.0)}

    ctx = tiny_context()
    cfg = load_config(None, ["fedala.max_start_epochs=3"])
    init = params_of(ctx, 0)
    wrapped = _wrapped(Mine(Mine.settings_class(), ctx.train, ctx.units), cfg)
    assert wrapped.round_metrics({0: {}, 1: {}})["mine"] == 2
    assert wrapped.summary_metrics(init)["mine"] == 2 and wrapped.summary_metrics(init)["ala_weights"] > 0
    state = wrapped.init_client(init, 0)
    assert "extra" in state and "ala" in state
    state, metrics = wrapped.local_init({"global": params_of(ctx, 1)}, state, ctx)
    assert received == [ctx.round] and "after" in state and "after_receive" in metrics and "ala_epochs" in metrics


def test_a_method_that_overrides_local_init_is_refused_under_ala():
    from pflkit.algorithms.fedavg import FedAvg

    class Whole(FedAvg):
        name = "whole"

        def local_init(self, payload, state, ctx):
            return state, {}

    cfg = load_config(None, [])
    with pytest.raises(ValueError, match="overrides local_init"):
        _wrapped(Whole(Whole.settings_class(), cfg.train, [("fc", ["f.w"])]), cfg)


def test_the_write_a_method_page_shows_the_example_file():
    page = (EXAMPLE.parents[1] / "tutorials" / "write-a-method.md").read_text()
    first_block = page.split("```python\n", 1)[1].split("```", 1)[0]
    assert first_block == EXAMPLE.read_text()

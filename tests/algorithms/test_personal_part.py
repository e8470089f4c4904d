"""The personal part a method keeps on its clients (``Algorithm.personal_part``): what travels for a
personal head (FedRep, FedPer) and a personal body (LG-FedAvg), batch-norm statistics, the refusal of
a model without a body and a head, ALA on what is downloaded, and a resumed run of both methods."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pflkit.algorithms import TrainSettings
from pflkit.config import load_config
from pflkit.methods import REGISTRY, build_algorithm
from pflkit.models import UnitModel, buffer_names, build_model, head_names
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.support.builders import build, params_of, tiny_context
from tests.support.runs import InterruptAfter, records_without_timings


def built(name: str, model: nn.Module, train: TrainSettings | None = None):
    return build_algorithm(name, load_config(None, []).algorithm_sections(), train or TrainSettings(), model.units())


def test_a_personal_head_sends_the_body_and_a_personal_body_sends_the_head():
    model = build_model("digits_cnn", (1, 8, 8), 10)
    names = [k for k, _ in model.named_parameters()]
    head = head_names(model.units())
    body = [k for k in names if k not in head]
    params = {k: v.detach() for k, v in model.named_parameters()}
    for name, personal, sent in (("fedavg", [], names), ("fedper", head, body), ("fedrep", head, body)):
        alg = built(name, model)
        assert alg.personal_names == frozenset(personal) and alg.downloaded_names(names) == sent, name
        assert list(alg.shared(params)) == sent, name
    lg = built("lgfedavg", model)
    assert lg.personal_names == frozenset(body)
    assert lg.downloaded_names(names) == list(lg.shared(params)) == head
    assert list(built("lgfedavg+ala", model).shared(params)) == head  # the wrapper keeps the base's part


@pytest.mark.parametrize("bn_buffers", ["local", "global"])
def test_batch_norm_statistics_belong_to_the_body(bn_buffers):
    model = build_model("resnet18", (3, 32, 32), 10)
    params = {k: v.detach() for k, v in model.named_parameters()}
    params.update({k: b.detach() for k, b in model.named_buffers() if k in buffer_names(model)})
    buffers = set(buffer_names(model))
    train = TrainSettings(bn_buffers=bn_buffers)
    fedper, lg = built("fedper", model, train), built("lgfedavg", model, train)
    # a shared body carries its statistics where the run shares them; a personal body never does
    assert bool(buffers & set(fedper.downloaded_names(list(params)))) == (bn_buffers == "global")
    assert buffers <= set(fedper.shared(params))  # uploaded and averaged, as FedAvg's
    assert not buffers & (set(lg.downloaded_names(list(params))) | set(lg.shared(params)))


class OneUnit(UnitModel):
    """A linear classifier of one unit: no body under its head."""

    unit_modules = ("fc",)

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def unit_forward(self, index, params, x):
        return F.linear(x.flatten(1), params["fc.weight"], params["fc.bias"])


def _needs_a_body(name: str) -> bool:
    cls = REGISTRY.algorithms[name]
    return cls.body_use is not None or cls.personal_part in ("head", "body")


BODY_METHODS = sorted(n for n in REGISTRY.algorithms if _needs_a_body(n))


def test_every_method_that_uses_a_body_is_checked():
    """The methods below split the model into a body and a head; a new one joins the test by itself."""
    expected = {"fedbabu", "moon", "fedper", "lgfedavg", "fedrep", "fedproto", "fedpac", "fedgh", "feddbe"}
    assert expected | {"fedcp", "gpfl", "fedas"} <= set(BODY_METHODS)


@pytest.mark.parametrize("name", [*BODY_METHODS, "fedper+ala"])
def test_every_method_that_splits_the_model_refuses_one_unit_in_one_line(name):
    with pytest.raises(ValueError) as error:
        built(name, OneUnit())
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{name.split('+')[0]} ")
    assert "at least two units (a body and a head)" in message and "'fc' (fc.weight, fc.bias)" in message
    cls = REGISTRY.algorithms[name.split("+")[0]]
    if cls.body_use is None:  # the refusal states the part the method keeps
        assert message.startswith(f"{cls.name} keeps the model's {cls.personal_part} on each client")


def test_a_method_that_keeps_nothing_takes_a_model_of_one_unit():
    built("fedavg", OneUnit())


@pytest.mark.parametrize("name,personal", [("fedper+ala", "head"), ("lgfedavg+ala", "body")])
def test_ala_initialises_what_is_downloaded_and_leaves_the_personal_part(name, personal):
    ctx = tiny_context(n_train=30)
    alg = build(name, ctx, "fedala.max_start_epochs=3")
    head = head_names(ctx.units)
    local, received = params_of(ctx, 1), params_of(ctx, 2)
    payload = alg.downlink(alg.init_server(received), 0, 2)
    state, metrics = alg.local_init(payload, alg.init_client(local, 0), ctx)
    model = state["model"]
    kept = head if personal == "head" else [k for k in local if k not in head]
    top = ["fc1.weight", "fc1.bias"] if personal == "head" else head  # p = 1: the top downloaded unit
    assert metrics["ala_epochs"] > 0 and sorted(state["ala"]["weights"]) == sorted(top)
    assert all(torch.equal(model[k], local[k]) for k in kept)
    assert all(torch.equal(model[k], received[k]) for k in payload["global"] if k not in top)  # overwritten
    for k in top:  # blended: between the local and the received tensor, element by element
        low, high = torch.minimum(local[k], received[k]), torch.maximum(local[k], received[k])
        assert bool(((model[k] >= low - 1e-6) & (model[k] <= high + 1e-6)).all()), k
    assert any(not torch.equal(model[k], received[k]) for k in top)


@pytest.mark.integration
def test_fedper_and_lgfedavg_resume_after_an_interruption_to_the_uninterrupted_numbers(tmp_path, fast_config):
    overrides = fast_config + ['algorithms=["fedper","lgfedavg+ala"]', "rounds=3"]
    config = load_config(None, overrides)
    run_experiment(config, tmp_path / "full", progress=False, echo=lambda s: None)
    with pytest.raises(KeyboardInterrupt):  # inside lgfedavg+ala's run, after fedper finished
        run_experiment(
            config, tmp_path / "cut", progress=False, echo=lambda s: None, callbacks=[InterruptAfter("lgfedavg+ala", 2)]
        )
    resume_experiment(tmp_path / "cut", progress=False, echo=lambda s: None)
    records = records_without_timings(tmp_path / "cut")
    assert records == records_without_timings(tmp_path / "full")
    assert {r["algorithm"] for r in records} == {"fedper", "lgfedavg+ala"}

"""Steps replayed as graphs (the ``vmap-graphs`` engine): what a graph records must give, replayed,
the numbers of the eager steps. Without a GPU the recorder here stands in for CUDA's: it warms up
by taking the step, and a "capture" keeps the step function and calls it again on each replay
(like a CUDA graph, the capture itself takes no step). A step function that kept the step number
as a Python value instead of reading it from the graphs' device tensor would then repeat the
captured step's batch, as a real graph would, and fail these tests."""

from __future__ import annotations

import logging

import pytest
import torch

from pflkit.algorithms import TrainBatches
from pflkit.data.federated import FederatedData
from pflkit.engines import build_engine
from pflkit.engines.batched import BatchedClientContext
from pflkit.engines.graphs import StepGraphs
from pflkit.engines.stacking import stack
from pflkit.functional import classification_loss, proximal_loss
from pflkit.functional.training import SGD
from tests.support.builders import client_context, params_of, perturbed


class Replayed:
    def __init__(self, step, log):
        self.step, self.log = step, log

    def replay(self):
        self.log.append("replay")
        self.step()


class StandInRecorder:
    """Warm-up takes the step; a capture records the step function without running it."""

    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def warm(self, step):
        self.log.append("warm")
        step()

    def capture(self, step):
        self.log.append("capture")
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return Replayed(step, self.log)


SIZES = (200, 120, 70, 30)  # batch 10: 20, 12, 7 and 3 steps an epoch


def _contexts(log, fail=False):
    contexts = [
        client_context(i, n_train=n, data_seed=i, batch_size=10, lr=0.1, local_epochs=2) for i, n in enumerate(SIZES)
    ]
    fed = FederatedData.from_clients([c.data for c in contexts], 10, "toy")
    base = contexts[0]
    make = lambda graphs: BatchedClientContext(  # noqa: E731
        list(range(len(SIZES))), 1, 0, fed, base.model, base.units, base.train, "t", graphs=graphs
    )
    return base, make(None), make(lambda device: StandInRecorder(log, fail))


@pytest.mark.parametrize("case", ["plain", "proximal", "momentum", "some clients"])
def test_replayed_steps_train_to_the_eager_numbers_bit_for_bit(case):
    log: list[str] = []
    base, eager, graphed = _contexts(log)
    p0 = params_of(base, 1)
    start = stack([perturbed(p0, 5 + i, 0.05) for i in range(len(SIZES))])
    kwargs: dict = {"data": TrainBatches("train", 2)}
    loss = classification_loss
    if case == "proximal":
        loss = proximal_loss(classification_loss, 0.3)
        kwargs["aux"] = stack([{"anchor": perturbed(p0, 30 + i, 0.1)} for i in range(len(SIZES))])
    if case == "momentum":
        kwargs["optimizer"] = SGD(0.1, momentum=0.9, weight_decay=1e-3)
    if case == "some clients":
        kwargs["active"] = torch.tensor([True, False, True, True])
    ours, theirs = graphed.fit(start, loss, **kwargs), eager.fit(start, loss, **kwargs)
    assert all(torch.equal(ours.params[k], theirs.params[k]) for k in p0)
    for field in ("loss", "epochs", "last_loss", "steps"):
        torch.testing.assert_close(getattr(ours, field), getattr(theirs, field), rtol=0, atol=0, equal_nan=True)
    assert log.count("capture") >= 2 and log.count("replay") > log.count("capture")  # graphs did the work
    assert not torch.equal(ours.params["fc.weight"][0], start["fc.weight"][0])  # it trained
    assert int(ours.epochs.max()) == 2


class HostReadGuard(torch.Tensor):
    """A step number that refuses to be read on the host: CUDA cannot record a step that reads it
    (``int``, ``item``, or indexing with it as a 0-dim tensor, which PyTorch turns into ``item``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        reads = {torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.tolist}
        reads |= {torch.Tensor.__bool__, torch.Tensor.__float__}
        index = args[1] if func is torch.Tensor.__getitem__ and len(args) > 1 else ()
        index = index if isinstance(index, tuple) else (index,)
        if func in reads or any(isinstance(i, HostReadGuard) and i.dim() == 0 for i in index):
            raise AssertionError(f"the step number is read on the host ({func.__name__})")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_a_recorded_step_never_reads_the_step_number_on_the_host(monkeypatch):
    """The stand-in cannot see a host read (on the CPU it just reads the current value), so the
    step number refuses one; the numbers must still be the eager ones."""
    from pflkit.engines import batched

    class Guarded(StepGraphs):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.step_index = self.step_index.as_subclass(HostReadGuard)

    monkeypatch.setattr(batched, "StepGraphs", Guarded)
    log: list[str] = []
    base, eager, graphed = _contexts(log)
    start = stack([perturbed(params_of(base, 1), 5 + i, 0.05) for i in range(len(SIZES))])
    ours = graphed.fit(start, classification_loss, data=TrainBatches("train", 2))
    theirs = eager.fit(start, classification_loss, data=TrainBatches("train", 2))
    assert all(torch.equal(ours.params[k], theirs.params[k]) for k in start)
    assert graphed.graph_counts["replayed"] > 0 and eager.graph_counts["replayed"] == 0


def test_a_step_that_cannot_be_recorded_runs_eagerly_with_one_warning(caplog, monkeypatch):
    from pflkit.engines import graphs

    monkeypatch.setattr(graphs, "_warned", set())
    log: list[str] = []
    base, eager, graphed = _contexts(log, fail=True)
    start = stack([params_of(base, 1)] * len(SIZES))
    with caplog.at_level(logging.WARNING, logger="pflkit.engines.graphs"):
        ours = graphed.fit(start, classification_loss, data=TrainBatches("train", 2))
    theirs = eager.fit(start, classification_loss, data=TrainBatches("train", 2))
    assert all(torch.equal(ours.params[k], theirs.params[k]) for k in start)
    assert log.count("capture") == 2 and "replay" not in log  # once per epoch, then eager
    warnings = [r.getMessage() for r in caplog.records if "could not be recorded" in r.getMessage()]
    assert len(warnings) == 1 and "round 1" in warnings[0] and "not permitted" in warnings[0]


def test_the_graphs_of_an_epoch_follow_the_number_of_running_clients():
    """One warm-up, one capture and replays for each stretch of at least ``min_run`` steps at one
    number of running clients; shorter stretches run eagerly."""
    log: list[str] = []
    graphs = StepGraphs(StandInRecorder(log), torch.device("cpu"), "here", min_run=4)
    seen: list[tuple[int, int]] = []
    steps = [20, 12, 7, 3]  # sorted, largest first: n clients run while s < steps[n - 1]
    for s in range(20):
        n = sum(t > s for t in steps)
        graphs.run(n, s, steps[n - 1] - s, lambda n=n: seen.append((n, int(graphs.step_index))))
    assert seen == [(sum(t > s for t in steps), s) for s in range(20)]  # every step once, in order
    assert graphs.counts == {"eager": 3 + 3, "captured": 3, "replayed": 20 - 6}
    assert sorted(graphs.graphs) == [1, 2, 3]


def test_vmap_graphs_is_refused_off_cuda():
    from pflkit.engines.graphs import CudaGraphRecorder

    with pytest.raises(ValueError, match="needs device cuda"):
        build_engine("vmap-graphs", device="cpu")
    with pytest.raises(ValueError, match="not on cpu"):  # the engine built by hand, its data on the CPU
        CudaGraphRecorder(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_the_eager_numbers():
    """On a GPU: the real recorder against eager vmap steps (equal up to float reassociation)."""
    from pflkit.engines.graphs import CudaGraphRecorder
    from tests.support.builders import make_data

    cuda = torch.device("cuda")
    base = client_context(0, n_train=10, batch_size=10, lr=0.1, local_epochs=2)
    fed = make_data(list(SIZES), device="cuda")
    make = lambda graphs: BatchedClientContext(  # noqa: E731
        list(range(len(SIZES))), 1, 0, fed, base.model, base.units, base.train, "t", graphs=graphs
    )
    start = stack([perturbed(params_of(base, 1), 5 + i, 0.05) for i in range(len(SIZES))], cuda)
    loss = proximal_loss(classification_loss, 0.3)
    graphed = make(CudaGraphRecorder)
    ours = graphed.fit(start, loss, aux={"anchor": start})
    theirs = make(None).fit(start, loss, aux={"anchor": start})
    for k in start:
        torch.testing.assert_close(ours.params[k], theirs.params[k], rtol=1e-4, atol=1e-5)
    assert not torch.equal(ours.params["fc.weight"], start["fc.weight"])
    # the graphs did the work: a failed capture falls back to eager steps with the same numbers
    assert graphed.graph_counts["captured"] >= 2 and graphed.graph_counts["replayed"] > 0, graphed.graph_counts

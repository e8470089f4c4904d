"""A run of the server optimisers interrupted in each method's third round and resumed gives the
uninterrupted run's records: their state (momentum, m, v) travels in the checkpoint."""

from __future__ import annotations

import pytest

from pflkit.config import load_config
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.support.runs import records_without_timings

METHODS = ["fedavgm", "fedadagrad", "fedadam", "fedyogi"]


class InterruptEach:
    """Callback: raise KeyboardInterrupt once per method, when it has finished training round ``round``."""

    def __init__(self, round: int) -> None:
        self.round = round
        self.done: set[str] = set()

    def on_record(self, state, record) -> None:
        if state.rounds_done == self.round and not state.done and state.algorithm not in self.done:
            self.done.add(state.algorithm)
            raise KeyboardInterrupt("simulated interruption")


@pytest.mark.integration
def test_server_optimizers_resumed_after_interruptions_equal_the_uninterrupted_run(tmp_path, fast_config):
    cfg = load_config(None, fast_config + [f"algorithms={METHODS!r}".replace("'", '"'), "rounds=4"])
    quiet = {"progress": False, "echo": lambda s: None}
    run_experiment(cfg, tmp_path / "full", **quiet)
    interrupt = InterruptEach(3)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", callbacks=[interrupt], **quiet)
    for _ in METHODS[1:]:
        with pytest.raises(KeyboardInterrupt):
            resume_experiment(tmp_path / "cut", callbacks=[interrupt], **quiet)
    resume_experiment(tmp_path / "cut", callbacks=[interrupt], **quiet)
    assert interrupt.done == set(METHODS)
    assert records_without_timings(tmp_path / "cut") == records_without_timings(tmp_path / "full")

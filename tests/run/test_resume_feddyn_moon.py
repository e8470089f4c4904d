"""FedDyn and MOON interrupted in their third round and resumed give the uninterrupted run's records:
their state (FedDyn's h and each client's ∇L_i, MOON's previous local models) travels in the checkpoint."""

from __future__ import annotations

import pytest

from pflkit.config import load_config
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.run.test_resume_server_optimizers import InterruptEach
from tests.support.runs import records_without_timings

METHODS = ["feddyn", "moon"]


@pytest.mark.integration
def test_feddyn_and_moon_resumed_after_interruptions_equal_the_uninterrupted_run(tmp_path, fast_config):
    cfg = load_config(None, fast_config + [f"algorithms={METHODS!r}".replace("'", '"'), "rounds=4", "feddyn.alpha=0.1"])
    quiet = {"progress": False, "echo": lambda s: None}
    run_experiment(cfg, tmp_path / "full", **quiet)
    interrupt = InterruptEach(3)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", callbacks=[interrupt], **quiet)
    with pytest.raises(KeyboardInterrupt):
        resume_experiment(tmp_path / "cut", callbacks=[interrupt], **quiet)
    resume_experiment(tmp_path / "cut", callbacks=[interrupt], **quiet)
    assert interrupt.done == set(METHODS)
    assert records_without_timings(tmp_path / "cut") == records_without_timings(tmp_path / "full")

"""An APFL run interrupted in its third round and resumed gives the uninterrupted run's records: each
client's personal model and mixing weight travel in the checkpoint."""

from __future__ import annotations

import pytest

from pflkit.config import load_config
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.run.test_resume_server_optimizers import InterruptEach
from tests.support.runs import records_without_timings


@pytest.mark.integration
def test_apfl_resumed_after_an_interruption_equals_the_uninterrupted_run(tmp_path, fast_config):
    cfg = load_config(None, fast_config + ['algorithms=["apfl"]', "rounds=4"])
    quiet = {"progress": False, "echo": lambda s: None}
    run_experiment(cfg, tmp_path / "full", **quiet)
    interrupt = InterruptEach(3)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", callbacks=[interrupt], **quiet)
    resume_experiment(tmp_path / "cut", callbacks=[interrupt], **quiet)
    assert interrupt.done == {"apfl"}
    full = records_without_timings(tmp_path / "full")
    assert records_without_timings(tmp_path / "cut") == full
    alphas = [r["alpha"] for r in full if "alpha" in r]
    assert len(set(alphas)) > 1  # alpha moves from round to round, so its state matters

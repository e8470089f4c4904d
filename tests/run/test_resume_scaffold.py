"""A SCAFFOLD run with partial participation, interrupted after its second round and resumed, gives
the uninterrupted run's records: c (server state) and every c_i (client state) travel in the
checkpoint."""

from __future__ import annotations

import pytest

from pflkit.algorithms.scaffold import CONTROL
from pflkit.config import load_config
from pflkit.federation.checkpoint import load_checkpoint
from pflkit.federation.results import ResultsFolder
from pflkit.run.experiment import resume_experiment, run_experiment
from tests.support.runs import InterruptAfter, records_without_timings


@pytest.mark.integration
def test_scaffold_resumed_after_an_interruption_equals_the_uninterrupted_run(tmp_path, fast_config):
    cfg = load_config(None, fast_config + ['algorithms=["scaffold"]', "rounds=4", "join_ratio=0.5"])
    quiet = {"progress": False, "echo": lambda s: None}
    run_experiment(cfg, tmp_path / "full", **quiet)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path / "cut", callbacks=[InterruptAfter("scaffold", 2)], **quiet)
    saved = load_checkpoint(ResultsFolder(tmp_path / "cut").checkpoint_path("scaffold", 0))
    assert saved.rounds_done == 2 and any(v.any() for v in saved.server[CONTROL].values())
    trained = [s for s in (saved.clients.get(i) for i in range(4)) if s and any(v.any() for v in s[CONTROL].values())]
    assert len(trained) >= 2  # the c_i of the clients sampled so far
    resume_experiment(tmp_path / "cut", **quiet)
    assert records_without_timings(tmp_path / "cut") == records_without_timings(tmp_path / "full")

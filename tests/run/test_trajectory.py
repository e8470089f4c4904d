"""[trace] clients and pflkit plot trajectory (FedALA Fig. 4)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.config import ConfigError, load_config
from pflkit.run.experiment import run_experiment
from pflkit.run.trajectory import load_trace


@pytest.mark.integration
def test_traced_models_are_the_clients_scored_models_and_plot_on_a_pca_plane(tmp_path) -> None:
    config = load_config(None, ["num_clients=4", "rounds=3", 'algorithms=["fedavg", "fedala"]', "trace.clients=[1]"])
    run_experiment(config, tmp_path / "run", progress=False, echo=lambda s: None)
    steps = load_trace(tmp_path / "run" / "trace" / "fedala-seed0", 1)
    assert [r for r, _ in steps] == [1, 2, 3]
    final = torch.load(tmp_path / "run" / "checkpoints" / "fedala-seed0.pt", weights_only=True)
    assert all(torch.equal(steps[-1][1][k], v) for k, v in final["clients"][1]["model"].items())
    result = CliRunner().invoke(main, ["plot", "trajectory", str(tmp_path / "run"), "--client", "1", "--grid", "5"])
    assert result.exit_code == 0 and (tmp_path / "run" / "plots" / "trajectory-client1.png").is_file()
    result = CliRunner().invoke(main, ["plot", "trajectory", str(tmp_path / "run"), "--client", "2"])
    assert result.exit_code == 2 and "no trace of client 2" in result.output


def test_traced_clients_must_exist() -> None:
    with pytest.raises(ConfigError, match=r"trace.clients \[7\] are not clients of this run"):
        load_config(None, ["num_clients=4", "trace.clients=[7]"])

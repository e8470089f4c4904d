import os

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
torch.set_num_threads(1)


@pytest.fixture
def fast_config() -> list[str]:
    """Overrides for a seconds-long experiment on the synthetic source."""
    return [
        "dataset=synthetic",
        "num_clients=4",
        "alpha=0.5",
        "rounds=2",
        "lr=0.05",
        "fedala.max_start_epochs=5",
        "fedrep.head_epochs=1",
        "ditto.personal_epochs=1",
    ]

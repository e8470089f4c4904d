"""What a federated run is, for every way of running one (simulator or Flower): the round
driver, the set-up of a config, the experiment loop, results folders and checkpoints."""

from .checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from .driver import Callback, RoundDriver, RoundPlan, RunState, sample_clients
from .evaluation import GlobalEvaluation
from .results import MetricsWriter, ResultsFolder
from .runner import Executor, SeedSetup, run_all
from .setup import build_partitions, initial_params, partition_dataset, partition_seed, partition_spec, resolve_device

__all__ = ["Checkpointer", "load_checkpoint", "save_checkpoint", "Callback", "RoundDriver", "RoundPlan", "RunState",
           "sample_clients", "GlobalEvaluation", "MetricsWriter", "ResultsFolder", "Executor", "SeedSetup", "run_all",
           "build_partitions", "initial_params", "partition_dataset", "partition_seed", "partition_spec",
           "resolve_device"]

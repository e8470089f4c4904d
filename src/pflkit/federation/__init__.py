"""What a federated run is, for every way of running one (simulator or Flower): the round
driver, the set-up of a config, the experiment loop, results folders and checkpoints."""

from .checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from .driver import Callback, RoundDriver, RoundPlan, RunState, sample_clients
from .evaluation import GlobalEvaluation
from .preparation import (
    build_partitions,
    initial_model,
    initial_params,
    partition_dataset,
    partition_seed,
    resolve_device,
)
from .results import FolderBusyError, MetricsWriter, ResultsFolder, folder_lock
from .runner import Backend, RunInterrupted, SeedStart, run_all
from .session import RunJobs, RunSession
from .state_store import ClientStore, DiskStateStore, MemoryStateStore
from .stopping import check_stop, signals_deferred, stop_on_signals

__all__ = [
    "Checkpointer",
    "load_checkpoint",
    "save_checkpoint",
    "Callback",
    "RoundDriver",
    "RoundPlan",
    "RunState",
    "sample_clients",
    "GlobalEvaluation",
    "MetricsWriter",
    "ResultsFolder",
    "FolderBusyError",
    "folder_lock",
    "Backend",
    "RunInterrupted",
    "SeedStart",
    "run_all",
    "check_stop",
    "stop_on_signals",
    "signals_deferred",
    "build_partitions",
    "initial_params",
    "initial_model",
    "partition_dataset",
    "partition_seed",
    "resolve_device",
    "RunJobs",
    "RunSession",
    "ClientStore",
    "DiskStateStore",
    "MemoryStateStore",
]

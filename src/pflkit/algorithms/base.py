"""The algorithm abstraction: pure per-client and server functions over parameter dictionaries.

An algorithm never owns a loop and never keeps client state on itself. The round loop
(``pflkit.run.rounds``) calls, for each sampled client ``i`` of round ``t``::

    payload = alg.downlink(server_state, i, t)            # what the server sends to client i
    state   = alg.local_init(payload, state_i, ctx)        # receive (overwrite; ALA replaces it),
                                                           # then after_receive
    [evaluate alg.eval_params(state) on client i's test split]
    state, upload, metrics = alg.local_train(payload, state, ctx)
    ...
    server_state = alg.aggregate(server_state, uploads, t)

Client state is a plain dict (tensors, parameter dicts, numbers) kept by the caller in a keyed
store, so the same functions run sequentially, batched, or on Flower clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from ..data.federated import ClientData
from ..functional import Params, clone, forward, sgd, torch_generator, weighted_average
from ..functional.training import Batch
from ..models import Units

State = dict[str, Any]
Payload = dict[str, Any]
Upload = dict[str, Any]


class Settings(BaseModel):
    """Base of every algorithm's hyperparameter section (``[name]`` in the config)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


@dataclass(frozen=True)
class TrainSettings:
    """Local-training settings shared by every algorithm (spec §0.2)."""

    batch_size: int = 10
    local_epochs: int = 1
    lr: float = 0.1
    eval_batch_size: int = 1000
    rounds: int = 1  # T, the run's total rounds (FedPHP's and APPLE's schedules)
    bn_buffers: str = "local"  # "local": batch-norm statistics are not downloaded (spec §0.2)

    @classmethod
    def from_config(cls, config: Any) -> "TrainSettings":
        return cls(batch_size=config.batch_size, local_epochs=config.local_epochs, lr=config.lr,
                   eval_batch_size=config.eval_batch_size, rounds=config.rounds, bn_buffers=config.bn_buffers)


@dataclass
class ClientSummary:
    """What a client may reveal before training starts (used by ``Algorithm.prepare``)."""

    client_id: int
    num_train: int
    label_counts: np.ndarray


@dataclass
class ClientContext:
    """Everything a client function may use besides its state and payload."""

    client_id: int
    round: int
    seed: int
    data: ClientData
    model: nn.Module
    units: Units
    train: TrainSettings
    algorithm: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def generator(self, purpose: str) -> torch.Generator:
        """A fresh generator for (seed, round, client, purpose): same draws on every engine."""
        return torch_generator(self.seed, "client", self.round, self.client_id, purpose)

    def where(self, stage: str) -> str:
        return f"algorithm {self.algorithm}, client {self.client_id}, round {self.round}, {stage}"

    def sgd(self, params: Params, *, purpose: str = "train", epochs: int = 1,
            trainable: Sequence[str] | None = None, prox_anchor: Mapping[str, torch.Tensor] | None = None,
            prox_mu: float = 0.0, stage: str = "local training") -> tuple[Params, float]:
        """``epochs`` epochs of plain SGD at the local lr over this client's ``purpose`` batches.

        Algorithms train only through this method, so an engine can substitute a batched
        implementation (many clients at once) without changing algorithm code.
        """
        return sgd(self.model, params, self.batches(purpose, epochs), self.train.lr, trainable=trainable,
                   prox_anchor=prox_anchor, prox_mu=prox_mu, where=self.where(stage))

    def logits(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, start: int = 0, stop: int | None = None,
               *, train: bool = True) -> torch.Tensor:
        """Units ``start..stop-1`` of the model on ``params`` (custom training loops use this).

        ``train=True`` is the training-mode forward (batch-norm batch statistics); callers of
        training-mode forwards own the tensors in ``params`` (clones), because running
        statistics found there may be updated in place.
        """
        return forward(self.model, params, x, start, stop, train=train)

    def batches(self, purpose: str = "train", epochs: int = 1) -> Iterator[Batch]:
        """Shuffled mini-batches of the client's training data, ``epochs`` times.

        Like PFLlib's loader (shuffle=True, drop_last=True) except that a client with fewer
        samples than one batch trains on one batch holding all its samples.
        """
        x, y = self.data.train_x, self.data.train_y
        for idx in batch_order(len(y), self.train.batch_size, epochs, self.generator(purpose)):
            idx = idx.to(x.device)
            yield x[idx], y[idx]


def batch_order(n: int, batch_size: int, epochs: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Index batches of one client: a fresh permutation per epoch, full batches only (drop_last),
    except that fewer than ``batch_size`` samples make one batch of all of them."""
    if n == 0:
        return []
    full = n // batch_size if n >= batch_size else 1
    size = batch_size if n >= batch_size else n
    out = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        out.extend(order[k * size:(k + 1) * size] for k in range(full))
    return out


class Algorithm:
    """Base class: FedAvg behaviour everywhere; subclasses override what their method changes.

    Class attributes:
      name: config name.
      settings_class: the pydantic model of its ``[name]`` config section.
      ala_targets: ALA targets this algorithm offers, ``target -> (payload key, state key)``:
        the state entry whose overwrite by the downloaded payload entry ALA may replace.
      default_ala_target: the target used unless the settings choose another.
      supports_batching: False when the client functions use more than ``ctx.sgd`` (custom
        training loops); the vmap engine then runs those clients one by one (logged).
      requires_full_participation: True for cross-silo methods that need every client in every
        round (FedAMP, APPLE); configs with join_ratio < 1 are refused.
    """

    name: ClassVar[str] = ""
    settings_class: ClassVar[type[Settings]] = Settings
    ala_targets: ClassVar[dict[str, tuple[str, str]]] = {"model": ("global", "model")}
    default_ala_target: ClassVar[str] = "model"
    supports_batching: ClassVar[bool] = True
    requires_full_participation: ClassVar[bool] = False

    def __init__(self, settings: Settings, train: TrainSettings, units: Units) -> None:
        self.settings = settings
        self.train = train
        self.units = units

    @property
    def ala_target(self) -> str:
        return getattr(self.settings, "ala_target", self.default_ala_target)

    # ---- server side -------------------------------------------------------------------
    def init_server(self, init_params: Params) -> State:
        return {"global": clone(init_params)}

    def prepare(self, server: State, clients: list[ClientSummary]) -> State:
        """Server-side preparation before round 1 from client summaries (default: nothing)."""
        return server

    def downloaded_names(self, names: list[str]) -> list[str]:
        """Which entries of the global model the downlink carries: all parameters, and the
        batch-norm buffers only with ``bn_buffers = "global"`` (FedRep: the body only)."""
        if self.train.bn_buffers == "global":
            return names
        parameters = {n for _, members in self.units for n in members}
        return [n for n in names if n in parameters]

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        names = self.downloaded_names(list(server["global"]))
        if len(names) == len(server["global"]):
            return {"global": server["global"]}
        return {"global": {k: server["global"][k] for k in names}}

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        """Sample-weighted average of the uploaded ``params`` (spec §0.2)."""
        merged = weighted_average([u["params"] for u in uploads], [u["num_samples"] for u in uploads])
        return {**server, "global": {**server["global"], **merged}}

    def global_params(self, server: State) -> Params:
        return server["global"]

    # ---- client side -------------------------------------------------------------------
    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": clone(init_params)}

    def local_init(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        """The client's initialisation for this round: ``receive``, then ``after_receive``."""
        return self.after_receive(payload, self.receive(payload, state, ctx), ctx)

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        """Overwrite the local model with the downloaded one: the step ALA replaces (spec §1.8)."""
        return {**state, "model": {**state["model"], **clone(payload["global"])}}

    def after_receive(self, payload: Payload, state: State, ctx: ClientContext) -> State:
        """Work done on the initialised state before evaluation (FedAvg-C's fine-tuning,
        Per-FedAvg's one-step adaptation); runs after ALA too. Default: nothing."""
        return state

    def local_train(self, payload: Payload, state: State,
                    ctx: ClientContext) -> tuple[State, Upload, dict[str, float]]:
        raise NotImplementedError

    def eval_params(self, state: State) -> Params:
        """The model scored on the client's test split right after ``local_init`` (spec §5.7)."""
        return state["model"]

    @staticmethod
    def keep_latest_models(server: State, uploads: list[Upload]) -> State:
        """Server rule of methods that send client models to other clients (FedAMP, FedFomo,
        APPLE): ``models`` keeps every client's latest upload; ``global`` becomes their
        sample-weighted average (the run's reference global model)."""
        models = {**server["models"], **{u["client_id"]: u["params"] for u in uploads}}
        merged = weighted_average([u["params"] for u in uploads], [u["num_samples"] for u in uploads])
        return {**server, "models": models, "global": {**server["global"], **merged}}

    @staticmethod
    def upload(params: Mapping[str, torch.Tensor], ctx: ClientContext, **extra: Any) -> Upload:
        return {"params": dict(params), "num_samples": ctx.data.num_train, **extra}

"""The algorithm abstraction: pure per-client and server functions over parameter dictionaries.

An algorithm never owns a loop and never keeps client state on itself. The round driver
(``pflkit.federation.driver``) calls, for each sampled client ``i`` of round ``t``::

    payload          = alg.downlink(server_state, i, t)      # what the server sends to client i
    state, metrics   = alg.local_init(payload, state_i, ctx) # receive (overwrite; ALA replaces it),
                                                             # then after_receive
    [evaluate alg.eval_params(state) on client i's test data]
    state, upload, metrics = alg.local_train(payload, state, ctx)
    ...
    server_state = alg.aggregate(server_state, uploads, t)

Client state is a plain dict (tensors, parameter dicts, numbers) kept by the caller in a keyed
store, so the same functions run for one client, batched over many (``ctx`` is then a batched
context, see ``pflkit.algorithms.context``), or on Flower clients. Client functions return their
metrics; values are numbers (one client) or [K] tensors (batched).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, TypedDict

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from ..functional import Params, WeightedSum, clone, weighted_average
from ..functional.training import Ensemble, LossFn, classification_loss
from ..models import Units, buffer_names, norm_layers, parameter_names
from .card import MethodCard
from .context import ClientContext, Fit, Metrics, PerClient, TrainBatches, TrainSettings

State = dict[str, Any]
Payload = dict[str, Any]
#: The server state of every method: the global model (plus method-specific entries).
ServerState = TypedDict("ServerState", {"global": Params})
#: The payload of methods that download the global model.
GlobalPayload = TypedDict("GlobalPayload", {"global": Params})


class Upload(TypedDict):
    """What a client sends after training: its parameters and its training-set size (a tensor where
    the client makes it, a number once the engine splits the upload per client)."""

    params: Params
    num_samples: PerClient | int


class SentUpload(TypedDict):
    """An upload as the server sees it: its training-set size a number, tagged with its sender."""

    params: Params
    num_samples: int
    client_id: int


class ModelState(TypedDict):
    """The client state of methods that keep one local model."""

    model: Params


Init = tuple[State, Metrics]
Trained = tuple[State, Upload, Metrics]


class Settings(BaseModel):
    """Base of every algorithm's hyperparameter section (``[name]`` in the config)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


@dataclass
class ClientSummary:
    """What a client may reveal before training starts (used by ``Algorithm.prepare``)."""

    client_id: int
    num_train: int
    label_counts: np.ndarray


#: key of the server state under which ``aggregate`` may leave numbers for the round's record
ROUND_INFO = "round_info"


def upload_order(upload: SentUpload) -> tuple[float, int]:
    """The order a weighted-sum server rule folds uploads in: largest training set first, then by
    client id; the order in which the engines finish their clients, so that folding them in as they
    arrive needs no buffer."""
    return -float(upload["num_samples"]), upload["client_id"]


class Aggregator(Protocol):
    """The streaming form of a server rule that is a weighted sum: uploads are folded in one at a
    time, in ``upload_order``, and ``result`` is the new server state (a round then never holds all
    its uploads at once)."""

    def add(self, upload: SentUpload) -> None: ...

    def result(self) -> State: ...


class WeightedAverage:
    """FedAvg's server rule as an ``Aggregator``: the sample-weighted average of the uploads'
    ``params`` replaces those entries of the global model. ``total``: the sum of the uploads'
    ``num_samples``, known before the first arrives."""

    def __init__(self, server: State, total: float) -> None:
        self.server = server
        self.sum = WeightedSum(total)

    def add(self, upload: SentUpload) -> None:
        self.sum.add(upload["params"], upload["num_samples"])

    def result(self) -> State:
        return {**self.server, "global": {**self.server["global"], **self.sum.result()}}


class Algorithm:
    """Base class: FedAvg behaviour everywhere; subclasses override what their method changes.

    Class attributes:
      name: config name.
      settings_class: the pydantic model of its ``[name]`` config section.
      section: the section's name where variants of one method share it (``sosicfl_all``).
      ala_targets: ALA targets this algorithm offers, ``target -> (payload key, state key)``:
        the state entry whose overwrite by the downloaded payload entry ALA may replace.
      default_ala_target: the target used unless the settings choose another.
      ala_refusal: why ``+ala`` is refused, for a method that downloads a model but offers no ALA
        target (None: the default reason, that it downloads no single model).
      needs: context capabilities the client functions use beyond the protocol every context
        implements (``"per_client"``: values read into Python); engines choose contexts that
        provide them.
      requires_full_participation: True for cross-silo methods that need every client in every
        round (FedAMP, APPLE); configs with join_ratio < 1 are refused.
      trains_on_receive: True when ``receive`` runs training steps of its own (ALA's weight
        learning): engines may batch that step across clients even where training runs per client.
      has_global_model: False when ``global_params`` is no model worth scoring (FedRep's server
        never trains a head; local training has none); global-test metrics skip such methods.
      personal_part: the part of the model that stays on each client: by the model's split into a
        body and a head (its last unit), ``"head"`` (FedRep, FedPer) or ``"body"`` (LG-FedAvg);
        ``"norm"``, its batch-norm layers, affine weights and running statistics (FedBN); or None
        (every parameter travels). The downlink leaves it out (``downloaded_names``), so
        ``receive`` and ALA initialise only the shared part; ``shared`` picks what to upload, so
        ``aggregate`` averages only the shared part. A model of one unit is refused for a head or a
        body, a model without batch norm for ``"norm"`` (``check_model``). Personal parameters
        added beside a fully shared model (FedROD's second head) are client state, not a
        ``personal_part``.
      newcomer_refusal: why the method has no model for a client that never trained (``[run]
        unseen_clients``), or None where ``newcomer_state`` and the downlink give it one; configs
        with unseen clients are refused for such methods.
      tta_base: the method whose best accuracy sets this one's time-to-accuracy target when both
        run together (SosicFL: FedAvg; SosicFL+: Ditto).
      metric_reductions: how a round's record reduces a client metric over the clients, where
        not the mean (``{"ala_epochs": "max"}``).
      card: the method's description (paper, scored model, reference code; ``MethodCard``), for
        ``pflkit algorithms`` and the documentation; optional, and not inherited by subclasses.
    """

    name: ClassVar[str] = ""
    settings_class: ClassVar[type[Settings]] = Settings
    section: ClassVar[str | None] = None  # the config section, when variants share one (default: name)
    ala_targets: ClassVar[dict[str, tuple[str, str]]] = {"model": ("global", "model")}
    default_ala_target: ClassVar[str] = "model"
    ala_refusal: ClassVar[str | None] = None
    needs: ClassVar[frozenset[str]] = frozenset()
    requires_full_participation: ClassVar[bool] = False
    trains_on_receive: ClassVar[bool] = False
    has_global_model: ClassVar[bool] = True
    personal_part: ClassVar[Literal["head", "body", "norm"] | None] = None
    tta_base: ClassVar[str | None] = None  # the method its time-to-accuracy is measured against
    newcomer_refusal: ClassVar[str | None] = None  # why a client that never trained gets no model
    #: what the method does with the model's body apart from its head (a one-unit model is then refused)
    body_use: ClassVar[str | None] = None
    #: how a round's record reduces each of the method's numeric client metrics over the clients
    #: (default: the mean, NaN values left out)
    metric_reductions: ClassVar[Mapping[str, Literal["mean", "sum", "max", "min"]]] = {}
    card: ClassVar[MethodCard | None] = None

    def __init__(self, settings: Settings, train: TrainSettings, units: Units) -> None:
        self.settings = settings
        self.train = train
        self.units = units
        use = self.body_use
        if use is None and self.personal_part in ("head", "body"):
            shared = "body" if self.personal_part == "head" else "head"
            use = f"keeps the model's {self.personal_part} on each client and shares its {shared}"
        if use is not None and len(units) < 2:
            raise ValueError(
                f"{self.name} {use}: it needs a model of at least two units (a body and a head), and this model "
                f"has one, {units[0][0]!r} ({', '.join(units[0][1])})"
            )
        if self.personal_part in ("head", "body") and self.head_units >= len(units):
            raise ValueError(
                f"{self.name}: a head of {self.head_units} units leaves no body in a model of {len(units)} units "
                f"({', '.join(u for u, _ in units)}): choose at most {len(units) - 1}"
            )

    @property
    def head_units(self) -> int:
        """How many of the model's top units form the head that a personal ``"head"`` or ``"body"``
        splits off (1: the last unit; FedPer's and LG-FedAvg's settings choose more)."""
        return 1

    @property
    def ala_target(self) -> str:
        return getattr(self.settings, "ala_target", self.default_ala_target)

    @property
    def parameter_names(self) -> list[str]:
        """Every trainable parameter of the model (batch-norm statistics are none)."""
        return parameter_names(self.units)

    def parameters_of(self, params: Mapping[str, torch.Tensor]) -> Params:
        """The parameters among ``params`` (no batch-norm statistics)."""
        names = set(self.parameter_names)
        return {k: v for k, v in params.items() if k in names}

    @property
    def personal_names(self) -> frozenset[str]:
        """The parameters that stay on the client (``personal_part``); none by default. A personal
        ``"norm"`` depends on the model's buffers: ``personal_entries`` names it."""
        return self.personal_entries(self.parameter_names) if self.personal_part != "norm" else frozenset()

    def personal_entries(self, names: Iterable[str]) -> frozenset[str]:
        """The entries among ``names`` (a client's model: parameters and batch-norm statistics) that
        stay on the client. The statistics belong to the body, so they stay with a personal body;
        a batch-norm layer is known by its ``running_mean`` among ``names``."""
        names = list(names)
        if self.personal_part is None:
            return frozenset()
        if self.personal_part == "norm":
            return frozenset(n for n in names if n.rsplit(".", 1)[0] in norm_layers(names))
        head = {n for _, unit in self.units[-self.head_units :] for n in unit}
        return frozenset(n for n in names if (n in head) == (self.personal_part == "head"))

    def is_shared(self, name: str, names: Iterable[str] | None = None) -> bool:
        """Whether entry ``name`` of a client's model travels (``names``: the model's entries, which
        a personal ``"norm"`` needs; default: the parameters)."""
        return name not in self.personal_entries(self.parameter_names if names is None else names)

    def shared(self, params: Mapping[str, torch.Tensor]) -> Params:
        """The entries of ``params`` a client uploads: all but its ``personal_part``."""
        personal = self.personal_entries(params)
        return {k: v for k, v in params.items() if k not in personal}

    def smallest_full_client(self) -> int:
        """The fewest training samples a client needs for every batch of this method's fits to be
        full (none padded): the training batch size by default. Engines run batch-norm models
        client by client below it (padding would enter the batch statistics)."""
        return self.train.batch_size

    def check_model(self, model: nn.Module) -> None:
        """Refuse, in one line naming the method and the model, a model without the layers the
        method keeps on its clients (batch norm for a personal ``"norm"``)."""
        if self.personal_part == "norm" and not norm_layers(buffer_names(model)):
            raise ValueError(
                f"{self.name} keeps the model's batch-norm layers on each client, and "
                f"{type(model).__name__} has none: choose a model with batch norm "
                "(fedbn_cnn, fedavg_cnn_bn, resnet18, mobilenet_v2)"
            )

    # ---- server side -------------------------------------------------------------------
    def init_server(self, init_params: Params) -> State:
        return {"global": clone(init_params)}

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        """Server-side preparation before round 1 from client summaries and the run seed
        (default: nothing)."""
        return server

    def downloaded_names(self, names: list[str]) -> list[str]:
        """Which entries of the global model the downlink carries: all parameters, and the
        batch-norm buffers only with ``bn_buffers = "global"``; none of the ``personal_part``."""
        personal = self.personal_entries(names)
        if self.train.bn_buffers != "global":
            parameters = set(self.parameter_names)
            names = [n for n in names if n in parameters]
        return [n for n in names if n not in personal]

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        names = self.downloaded_names(list(server["global"]))
        if len(names) == len(server["global"]):
            return {"global": server["global"]}
        return {"global": {k: server["global"][k] for k in names}}

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        """Sample-weighted average of the uploaded ``params``, folded in ``upload_order``.

        A method may put a dict of JSON values under ``ROUND_INFO`` in the returned state (e.g. its
        aggregation weights): the round driver moves it into the round's record."""
        average = WeightedAverage(server, sum(u["num_samples"] for u in uploads))
        for upload in sorted(uploads, key=upload_order):
            average.add(upload)
        return average.result()

    def aggregator(self, server: State, round: int, total: float) -> Aggregator | None:
        """``aggregate`` in streaming form, for uploads whose ``num_samples`` sum to ``total``; the
        driver folds each upload in as it arrives and gets the same bits as ``aggregate``. None
        (every method that overrides ``aggregate`` without overriding this): the server rule needs
        all uploads at once (FedFomo, APPLE, FedAMP, SosicFL's clustering, ...)."""
        if type(self).aggregate is not Algorithm.aggregate:
            return None
        return WeightedAverage(server, total)

    def fold(self, server: State, uploads: list[SentUpload], round: int) -> State:
        """``aggregate`` by way of ``aggregator``: the uploads folded in in ``upload_order``, so that
        a method whose server rule streams gets the same bits from a list of uploads (Flower)."""
        step = self.aggregator(server, round, sum(u["num_samples"] for u in uploads))
        if step is None:
            raise TypeError(f"{self.name} has no streaming server rule to fold its uploads with")
        for upload in sorted(uploads, key=upload_order):
            step.add(upload)
        return step.result()

    def global_params(self, server: State) -> Params:
        return server["global"]

    def summary_metrics(self, init_params: Params) -> dict[str, Any]:
        """Numbers the method reports once per run in ``summary.json`` (default: none)."""
        return {}

    def round_metrics(self, client_metrics: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
        """What the method reports of a training round beyond the driver's means of the clients'
        numeric metrics, from every participant's metrics (client id -> metrics); default: nothing."""
        return {}

    def schedule_rounds(self) -> int:
        """The first round whose training no longer follows a schedule of the method's own that
        changes its objective (APPLE's lambda(r)): the plateau rule judges a run only from the
        evaluation of this round on, since a plateau inside the schedule is no convergence.
        Default 0: no such schedule."""
        return 0

    def head_update(self, server: State, upload: SentUpload) -> torch.Tensor | None:
        """The upload's change of the last layer, flattened (the total variance of updates,
        SosicFL Eq. 10); None where the upload carries no head."""
        head = [k for k in self.units[-1][1] if k in upload["params"] and k in server["global"]]
        if not head:
            return None
        return torch.cat([(upload["params"][k] - server["global"][k]).flatten() for k in head])

    # ---- client side -------------------------------------------------------------------
    def init_client(self, init_params: Params, client_id: int) -> State:
        return {"model": clone(init_params)}

    def newcomer_state(self, init_params: Params, payload: Payload, client_id: int) -> State:
        """The state of a client that never trained (``[run] unseen_clients``), before
        ``local_init(payload)`` as in a participant's first round; ``payload`` is what the downlink
        sends it. Default: ``init_client``, the state every participant starts from."""
        return self.init_client(init_params, client_id)

    def local_init(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        """The client's initialisation for this round: ``receive``, then ``after_receive``."""
        state, received = self.receive(payload, state, ctx)
        state, prepared = self.after_receive(payload, state, ctx)
        return state, {**received, **prepared}

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        """Overwrite the local model with the downloaded one: the step ALA replaces."""
        return {**state, "model": {**state["model"], **clone(payload["global"])}}, {}

    def after_receive(self, payload: Payload, state: State, ctx: ClientContext) -> Init:
        """Work done on the initialised state before evaluation (FedAvg-C's fine-tuning,
        Per-FedAvg's one-step adaptation); runs after ALA too. Default: nothing."""
        return state, {}

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        """E epochs of the local objective (``loss``) from the local model; upload its shared part."""
        fit = self.train_model(state["model"], ctx, self.loss(), aux=self.loss_aux(payload, state, ctx))
        return {**state, "model": fit.params}, self.upload(self.shared(fit.params), ctx), {"train_loss": fit.loss}

    def loss(self) -> LossFn:
        """The local objective of ``local_train`` (default: cross-entropy)."""
        return classification_loss

    def loss_aux(self, payload: Payload, state: State, ctx: ClientContext) -> Any:
        """The per-client tensors ``loss`` reads (e.g. FedProx's anchor); default: none."""
        return None

    def train_model(
        self,
        params: Params,
        ctx: ClientContext,
        loss: LossFn,
        *,
        aux: Any = None,
        purpose: str = "train",
        epochs: int | None = None,
        **kwargs: Any,
    ) -> Fit:
        """``ctx.fit`` over the client's training batches (E epochs unless ``epochs``)."""
        data = TrainBatches(purpose, self.train.local_epochs if epochs is None else epochs)
        return ctx.fit(params, loss, aux=aux, data=data, **kwargs)

    def eval_params(self, state: State) -> Params | Ensemble:
        """The model scored on the client's test split right after ``local_init``."""
        return state["model"]

    def local_model(self, state: State) -> Params | Ensemble:
        """The trained local model that FedACD's adaptability metrics score (Tables 3 and 9: the
        model the client uploads); default: the scored model. FedROD: its generic model."""
        return self.eval_params(state)

    @staticmethod
    def keep_latest_models(server: State, uploads: list[SentUpload]) -> State:
        """Server rule of methods that send client models to other clients (FedAMP, FedFomo,
        APPLE): ``models`` keeps every client's latest upload; ``global`` becomes their
        sample-weighted average (the run's reference global model)."""
        models = {**server["models"], **{u["client_id"]: u["params"] for u in uploads}}
        merged = weighted_average([u["params"] for u in uploads], [u["num_samples"] for u in uploads])
        return {**server, "models": models, "global": {**server["global"], **merged}}

    @staticmethod
    def upload(params: Mapping[str, torch.Tensor], ctx: ClientContext, **extra: Any) -> Upload:
        # the ignore: Upload has no keys for a method's own entries (extra)
        return {"params": dict(params), "num_samples": ctx.num_train, **extra}  # type: ignore[typeddict-item]


#: server-state key of N, the federation's number of clients (``CountsClients.prepare``)
NUM_CLIENTS = "num_clients"


class CountsClients(Algorithm):
    """Base of the methods whose server rule reads N, the number of clients of the whole federation
    (not only a round's participants): ``prepare`` stores it in the server state (FedDyn's h, SCAFFOLD's c)."""

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        if not clients:
            raise ValueError(f"{self.name} needs at least one client")
        return {**server, NUM_CLIENTS: len(clients)}

    def num_clients(self, server: State) -> int:
        """N, as ``prepare`` stored it."""
        return int(require_entry(self.name, server, NUM_CLIENTS))


def require_entry(method: str, server: State, key: str) -> Any:
    """``server[key]``, or a ValueError saying the state was not started by ``method``."""
    if key not in server:
        raise ValueError(
            f"{method}: the server state has no {key!r}; start it with init_server and prepare "
            "(a checkpoint written by another method cannot continue this one)"
        )
    return server[key]

"""The sections of a config that the federation layer reads: ``[run]``, ``[metrics]``, ``[trace]``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..data.domain_sets import DomainOptions


class MetricsSettings(BaseModel):
    """The ``[metrics]`` section: metrics that cost extra passes."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    adaptability: bool = Field(
        False,
        description="after training, score every participant's local model by "
        "its risk over the clients' distributions and KL(P||T) (FedACD Tables 3 and 9; "
        "a pass over its training data and the global test set; test_set = official)",
    )
    template_gamma: float = Field(
        0.9, gt=0, lt=1, description="gamma of the template T of KL(P||T) [the paper leaves it open]"
    )


class TraceSettings(BaseModel):
    """The ``[trace]`` section: clients whose models are saved every round (FedALA Fig. 4)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    clients: list[int] = Field(
        default_factory=list,
        description="client ids whose scored model is saved after "
        "every round under trace/ in the results folder (pflkit plot trajectory; "
        "simulator only)",
    )


class RunSettings(BaseModel):
    """The ``[run]`` section, read by the federation layer and the executors: who trains and who
    is scored each round, on which engine and device, and how the run is checkpointed, stores
    client states and is tracked."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    join_ratio: float = Field(1.0, gt=0, le=1, description="share of the clients sampled each round")
    eval_every: int = Field(1, ge=1, description="rounds between evaluations")
    eval_all_clients: bool = Field(
        False,
        description="score every client at each evaluation, not only the "
        "next round's participants (SosicFL protocol; simulator only)",
    )
    unseen_clients: int | float | list[int] = Field(
        0,
        description="clients that never train, scored as newcomers at each evaluation: a count K (the last K "
        "client ids), a fraction in (0, 1) of the clients (rounded down, at least one; the last ones), or a list "
        "of client ids; every participant count (join_ratio, aggregation weights) refers to the other clients",
    )
    unseen_finetune_epochs: int = Field(
        0,
        ge=0,
        description="epochs of local SGD (cross-entropy, the run's train settings) an unseen client runs "
        "on its training split from what the method gives a newcomer, before it is scored (0: scored as received)",
    )
    unseen_finetune_steps: int | None = Field(
        None,
        ge=1,
        description="the fine-tuning budget of an unseen client in batches instead of epochs: exactly this many "
        "SGD steps, its batches reshuffled each epoch (with it, unseen_finetune_epochs stays 0)",
    )
    unseen_finetune_lr: float | None = Field(
        None,
        gt=0,
        description="learning rate of an unseen client's fine-tuning (default: the run's [train] lr); the "
        "rest of the train settings stay the run's",
    )
    engine: Literal["auto", "loop", "parallel", "vmap", "vmap-graphs"] = Field(
        "auto",
        description="loop: one client at a time; parallel: clients over worker threads; vmap: "
        "many clients batched with torch.func (for GPUs); vmap-graphs: vmap with each epoch's steps "
        "replayed as CUDA graphs (CUDA only); auto: vmap on CUDA, parallel on CPU",
    )
    workers: int | None = Field(None, ge=1, description="parallel engine workers (default: all cores)")
    device: str = Field("cpu", description="cpu, cuda, cuda:N or auto")
    threads: int = Field(1, ge=1, le=1024, description="torch intra-op threads per worker (set explicitly; see docs)")
    checkpoint_every: int = Field(
        1, ge=1, description="rounds between checkpoints (the first trained round is always saved, so any run resumes)"
    )
    state_store: Literal["memory", "disk"] = Field(
        "memory",
        description="where clients' states live between rounds: memory, or disk (one file per client "
        "under states/ in the results folder, read when sampled, written back after its round; checkpoints use "
        "the same files), for many stateful clients",
    )
    state_cache: int | None = Field(
        None,
        ge=1,
        description="state_store = disk: client states kept in memory "
        "(default: the clients of one round, at most 64; a client's state is read when "
        "its job starts, so memory holds the clients in flight and this cache)",
    )
    plateau_evaluations: int | None = Field(
        None,
        ge=1,
        description="stop a run once its best plateau_metric has not improved by more than "
        "plateau_points over the last this many evaluations (rounds is then the cap; FedALA's convergence rule: "
        "20; a method's own schedule, APPLE's lambda(r), is waited for); default: run every round",
    )
    plateau_points: float = Field(
        0.1, ge=0, description="plateau rule: the improvement, in percentage points, that counts as progress"
    )
    plateau_metric: Literal["accuracy", "global_accuracy", "local_accuracy"] = Field(
        "accuracy",
        description="plateau rule: the record's metric it watches (global_accuracy: methods without "
        "a global model fall back to accuracy)",
    )
    dropout_rate: float = Field(
        0.0,
        ge=0,
        description="unreliable clients: the chance that a selected client fails to return its upload, "
        "drawn for each (seed, round, client); a dropped client is absent from its round (not trained, not "
        "evaluated unless eval_all_clients, its state unchanged) and the round aggregates the uploads that "
        "arrived; in [0, 1)",
    )
    dropout_schedule: list[list[int]] = Field(
        default_factory=list,
        description="unreliable clients: [round, client] pairs (e.g. [[3, 0], [3, 5]]) naming who drops "
        "in which round (if selected then), on top of dropout_rate",
    )
    straggler_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        description="unreliable clients: the chance that a selected client straggles, drawn for each "
        "(seed, round, client): it takes only straggler_work of the local steps of each fit of its local training",
    )
    straggler_work: float = Field(
        0.5,
        gt=0,
        le=1,
        description="the share of its planned local steps a straggler takes (rounded down, at least one)",
    )
    round_deadline: float | None = Field(
        None,
        gt=0,
        description="unreliable clients: a round deadline on a simulated clock, in local steps of a client of "
        "median speed (speed 1); a client of speed s completes floor(round_deadline x s) steps (at least one), and "
        "one that planned more (local_epochs x its batches) is cut short as deadline_policy says; seeded, the same "
        "on every engine and on Flower; default: none",
    )
    client_speed_spread: float = Field(
        0.0,
        ge=0,
        description="round deadline: sigma of the clients' log-normal speeds (median 1), drawn once a run "
        "for each (seed, client); 0: every client has speed 1",
    )
    deadline_policy: Literal["partial", "drop"] = Field(
        "partial",
        description="round deadline: a client it cuts short returns the steps it completed (partial, as a "
        "straggler; FedProx's partial work) or fails to return (drop, as a dropped client; FedAvg's rule)",
    )
    reply_timeout: float = Field(
        3600.0,
        gt=0,
        description="Flower: the round's real deadline, the seconds the server waits for a round's replies; a "
        "client that has not replied by then failed (dropped with tolerate_failures, else the run stops); the "
        "ServerApp's run-config key timeout overrides it",
    )
    tolerate_failures: bool = Field(
        False,
        description="Flower: a client that fails or does not reply within the timeout counts as dropped "
        "for that round instead of stopping the run (the simulator's clients do not fail)",
    )
    min_replies: int = Field(
        1,
        ge=1,
        description="tolerate_failures: stop the run when fewer than this many of a round's clients reply "
        "(all of them where fewer were sent)",
    )
    tracker: Literal["none", "tensorboard"] = Field(
        "none",
        description="also write every record to TensorBoard event files under tensorboard/ in the results "
        "folder (needs the tensorboard extra: pip install -e '.[tensorboard]' in a pflkit clone)",
    )

    @field_validator("unseen_clients")
    @classmethod
    def _unseen_form(cls, value: int | float | list[int]) -> int | float | list[int]:
        if isinstance(value, int) and value < 0:
            raise ValueError("a count of clients cannot be negative")
        if isinstance(value, float) and not 0 < value < 1:
            raise ValueError("a fraction of the clients must lie in (0, 1)")
        if isinstance(value, list):
            if any(c < 0 for c in value):
                raise ValueError("client ids cannot be negative")
            if len(set(value)) != len(value):
                raise ValueError("client ids are repeated")
        return value

    def unseen_ids(self, num_clients: int | None) -> list[int]:
        """The ids of the clients that never train (``unseen_clients``) among ``num_clients``: the
        last K for a count or a fraction, the given ids for a list; ValueError where none would train.
        ``num_clients`` None (not known before the data is read): the ids a list gives, [0] for a
        count or a fraction (only whether any client is unseen is known)."""
        spec = self.unseen_clients
        if num_clients is None:
            return sorted(spec) if isinstance(spec, list) else [0] if spec else []
        if isinstance(spec, list):
            wrong = [c for c in spec if c >= num_clients]
            if wrong:
                raise ValueError(f"unseen client ids {wrong} are not clients of this run (ids 0..{num_clients - 1})")
            ids = sorted(spec)
        else:
            count = spec if isinstance(spec, int) else max(1, int(spec * num_clients))
            ids = list(range(num_clients - count, num_clients))
        if len(ids) >= num_clients:
            raise ValueError(
                f"{len(ids)} unseen clients of {num_clients} leave none to train: keep at least one participant"
            )
        return ids

    @field_validator("unseen_finetune_steps")
    @classmethod
    def _one_finetune_budget(cls, steps: int | None, info: ValidationInfo) -> int | None:
        epochs = info.data.get("unseen_finetune_epochs", 0)
        if steps is not None and epochs:
            raise ValueError(
                f"gives a budget in steps ({steps}) and unseen_finetune_epochs one in epochs ({epochs}): "
                "set one of the two"
            )
        return steps

    @field_validator("client_speed_spread", "deadline_policy")
    @classmethod
    def _deadline_settings_need_a_deadline(cls, value: float | str, info: ValidationInfo) -> float | str:
        default = cls.model_fields[str(info.field_name)].default
        if value != default and info.data.get("round_deadline") is None:
            raise ValueError(f"{info.field_name} = {value!r} has no effect without round_deadline: set one")
        return value

    @field_validator("dropout_rate")
    @classmethod
    def _dropout_below_one(cls, rate: float) -> float:
        if rate >= 1:
            raise ValueError(f"must be below 1, got {rate}: with every client dropping no round could aggregate")
        return rate

    @field_validator("dropout_schedule")
    @classmethod
    def _round_client_pairs(cls, pairs: list[list[int]]) -> list[list[int]]:
        for pair in pairs:
            if len(pair) != 2 or pair[0] < 1 or pair[1] < 0:
                raise ValueError(f"takes [round, client] pairs (round >= 1, client >= 0), got {pair}")
        return pairs

    @field_validator("device")
    @classmethod
    def _device_syntax(cls, device: str) -> str:
        if device not in ("cpu", "cuda", "auto") and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError("device must be cpu, cuda, cuda:N or auto")
        return device


class DataSettings(BaseModel):
    """The ``[data]`` section: settings of particular datasets (each read only by its dataset)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    emnist_split: Literal["byclass", "bymerge", "balanced", "letters", "digits", "mnist"] = Field(
        "balanced",
        description="dataset = emnist: which EMNIST split to read (byclass 62 classes, bymerge 47, balanced 47, "
        "letters 26 (labels 1..26 read as 0..25), digits 10, mnist 10)",
    )
    synthetic_alpha: float = Field(
        1.0,
        ge=0,
        description="dataset = fedprox_synthetic: alpha of Synthetic(alpha, beta), the spread of the clients' "
        "model means u_k ~ N(0, alpha) (FedProx: 0, 0.5, 1)",
    )
    synthetic_beta: float = Field(
        1.0,
        ge=0,
        description="dataset = fedprox_synthetic: beta of Synthetic(alpha, beta), the spread of the clients' "
        "input means B_k ~ N(0, beta) (FedProx: 0, 0.5, 1)",
    )
    synthetic_iid: bool = Field(
        False,
        description="dataset = fedprox_synthetic: FedProx's Synthetic-IID instead (one model for all "
        "clients, inputs centred at 0; alpha and beta unused)",
    )
    domains: list[str] | None = Field(
        None,
        description="digit5, office_caltech10, domainnet: the domains read, in client order (default: all; "
        "digit5: mnist, svhn, usps, synth, mnistm; office_caltech10: amazon, caltech, dslr, webcam; "
        "domainnet: clipart, infograph, painting, quickdraw, real, sketch)",
    )
    percent: float = Field(
        0.1,
        gt=0,
        le=1,
        description="digit5: share of each domain's training data, read as FedBN does (int(percent * 10) "
        "of its ten 743-image parts; below 0.1, the first percent * 10 of part 0)",
    )
    classes: list[str] | None = Field(
        None,
        description="office_caltech10, domainnet: the class folders read, labelled in this order "
        "(default: all, sorted; FedBN's DomainNet ten: bird, feather, headphones, ice_cream, teapot, tiger, "
        "whale, windmill, wine_glass, zebra)",
    )
    image_size: int = Field(
        64, ge=4, description="office_caltech10, domainnet: images are resized to image_size x image_size"
    )
    clients_per_domain: int = Field(
        1,
        ge=1,
        description="digit5, office_caltech10, domainnet: clients per domain; above 1, each domain's "
        "train and test images are split IID over its clients (from the partition seed)",
    )
    heldout_domains: list[str] = Field(
        default_factory=list,
        description="digit5, office_caltech10, domainnet: domains whose clients never train and are scored "
        "as newcomers, as [run] unseen_clients are (recorded as heldout_clients in partition-seed<k>.json)",
    )

    @field_validator("domains", "classes", "heldout_domains")
    @classmethod
    def _distinct_names(cls, names: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if names is not None and len(set(names)) != len(names):
            raise ValueError("contains duplicates")
        if names == [] and info.field_name != "heldout_domains":
            raise ValueError("is empty: name at least one, or leave it unset for all")
        return names

    def domain_options(self) -> DomainOptions:
        """What a multi-domain dataset reads and how its domains become clients."""
        return DomainOptions(
            domains=None if self.domains is None else tuple(self.domains),
            percent=self.percent,
            classes=None if self.classes is None else tuple(self.classes),
            image_size=self.image_size,
            clients_per_domain=self.clients_per_domain,
            heldout_domains=tuple(self.heldout_domains),
        )

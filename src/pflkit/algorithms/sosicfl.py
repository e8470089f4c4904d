"""SosicFL (solution simplex clustered FL), SosicFL-All and SosicFL+.

The model's head (``sosicfl``) or every parametrised layer (``sosicfl_all``) is a simplex of
M + 1 endpoint tensors; a point alpha of the simplex realises W(alpha) = sum_m alpha_m W_m
inside the loss, so autograd gives endpoint m the gradient alpha_m * dF/dW (Eq. 8) and the same
code trains one client or many batched clients with different alphas. Before round 1 the server
maps the clients' label counts to simplex points (LDA), clusters them and gives every cluster a
subregion with a pool of uniform points (``simplex.prepare_simplex``). Each round the server
sends a participant the endpoints, its cluster centre and its alphas drawn from its cluster's
pool (before the late start t~: from the whole simplex); the client trains the endpoints with
alpha cycling over its draws (one per round, or one per step); the server averages the
endpoints like FedAvg (over the participants, or the paper's literal N over all clients).
Global model: the simplex centroid; a client's model: its cluster centre.

SosicFL+ (SosicFL paper, Section 3.6) also keeps personal endpoints per client, trained every
round like Ditto's personal model (proximal term lam/2 ||theta_hat - theta||^2 toward the received
endpoints, alpha cycling over 10 subregion draws) and scored at the cluster centre.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from ..functional import Ensemble, Params, clone, numpy_generator
from ..functional.training import Batch, LossFn, Net, classification_loss, squared_distance
from ..models import head_names
from .base import Algorithm, ClientContext, ClientSummary, Payload, SentUpload, Settings, State, Trained
from .card import Choice, MethodCard, Paper, Reference
from .context import TrainBatches
from .registry import register
from .simplex import ENDPOINT, make_endpoints, prepare_simplex, realise

ALPHAS, STEP = "sosicfl.alphas", "sosicfl.step"  # frozen and carried entries of the fit


class SosicFLSettings(Settings):
    num_endpoints: int = Field(
        3,
        ge=2,
        description="M + 1, the simplex's endpoints (M = 2 "
        "as no setting is stated; M = 1 in the 2-Fold SqueezeNet study)",
    )
    num_clusters: int = Field(10, ge=1, description="C (paper: 10 for Dirichlet splits, 2 / 5 for 2-/5-Fold)")
    rho: float = Field(
        0.4,
        gt=0,
        description="subregion size: eta = rho * mean L1 distance from the centres "
        "to the simplex (paper: 0.6 for 2-Fold, 0.4 otherwise)",
    )
    metric: Literal["l1", "hilbert"] = Field("l1", description="clustering distance")
    cluster_algo: Literal["kmeans", "kcenter"] = Field(
        "kmeans", description="k-means++ (Lloyd) or k-center (farthest-first) clustering"
    )
    n_init: int = Field(10, ge=1, description="clustering restarts; the lowest cost is kept")
    hilbert_eps: float = Field(
        1e-6,
        gt=0,
        lt=1,
        description="the Hilbert metric's smoothing of boundary points: p <- (p + eps) / (1 + (M+1) eps)",
    )
    pool_size: int = Field(10_000, ge=1, description="uniform points pre-sampled per cluster subregion")
    late_start: int = Field(
        1,
        ge=0,
        description="t~: round from which clients sample their subregion "
        "(before: the whole simplex, scored at the centroid); 0 = never (t~ = infinity)",
    )
    alpha_resample: Literal["per_step", "per_round"] = Field(
        "per_step",
        description="a fresh alpha draw per local step (the paper's §3.2 step 2 and FLOCO's code), or "
        "samples_per_round draws per client and round that the steps cycle over",
    )
    samples_per_round: int = Field(
        1,
        ge=1,
        description="Omega_tr of SosicFL's own training with alpha_resample = per_round (the paper's Appendix A: 1)",
    )
    eval_samples: int = Field(
        1,
        ge=1,
        description="Omega_te: a client's model is the single model at its cluster "
        "centre (1, the paper's setting) or the softmax ensemble of this many models at "
        "points of its subregion",
    )
    server_weights: Literal["participants", "literal"] = Field(
        "participants",
        description="Eq. 9 weights N_k / N over the round's participants (default), or "
        "'literal': N over all clients (the paper's formula; shrinks the step with partial participation)",
    )
    simplex_bias: bool = Field(False, description="biases are simplex endpoints too (default: one shared bias)")
    plus_lam: float = Field(
        1.0,
        ge=0,
        description="SosicFL+: lambda of the personal proximal term (1.0, FLOCO's default; 0.1 as FedALA's Ditto)",
    )
    plus_samples: int = Field(10, ge=1, description="SosicFL+: Omega_tr of the personal training (paper: 10)")
    plus_mode: Literal["every_round", "post_hoc"] = Field(
        "every_round",
        description="SosicFL+: personalise each time a client participates (like Ditto), or "
        "post hoc: after the last round every client fine-tunes personal endpoints from the final global ones "
        'before its final evaluation ("applying Ditto after SosicFL training"); until then it is scored '
        "with the global endpoints",
    )


def simplex_loss(names: list[str], num_endpoints: int, prox: float = 0.0) -> LossFn:
    """Cross-entropy at the simplex point alphas[step mod Omega] (a one-hot pick, which vmap
    batches), plus ``prox``/2 ||params - aux["anchor"]||^2 on the endpoint and shared tensors
    (SosicFL+); returns the carried step counter + 1."""

    def loss(net: Net, params: Params, batch: Batch, aux: Any) -> Any:
        alphas, step = params[ALPHAS], params[STEP]
        pick = torch.arange(alphas.shape[0], device=alphas.device) == torch.remainder(step, alphas.shape[0])
        alpha = pick.to(alphas.dtype) @ alphas
        realised = realise({k: v for k, v in params.items() if k not in (ALPHAS, STEP)}, names, num_endpoints, alpha)
        value = classification_loss(net, realised, batch)
        if prox:
            anchor = aux["anchor"]
            value = value + prox / 2 * squared_distance({k: params[k] for k in anchor}, anchor)
        return value, {STEP: step + 1}

    return loss


@register
class SosicFL(Algorithm):
    name = "sosicfl"
    section = "sosicfl"
    settings_class = SosicFLSettings
    settings: SosicFLSettings
    ala_targets: ClassVar[dict[str, tuple[str, str]]] = {}  # several endpoints per layer: no single model to blend
    simplex_layers = "head"
    personal = False
    tta_base = "fedavg"
    newcomer_refusal = (
        "sosicfl gives each client the subregion of its cluster, assigned on the server from the label counts "
        "of the clients that take part"
    )

    def __init__(self, settings: Any, train: Any, units: Any) -> None:
        super().__init__(settings, train, units)
        layers = head_names(units) if self.simplex_layers == "head" else self.parameter_names
        self.simplex = [n for n in layers if self.settings.simplex_bias or not n.endswith("bias")]
        self.M1 = self.settings.num_endpoints
        self.centroid = torch.full((self.M1,), 1.0 / self.M1)

    @property
    def trainable(self) -> list[str]:
        """Endpoint tensors and the shared parameters."""
        shared = [n for n in self.parameter_names if n not in self.simplex]
        return shared + [f"{n}{ENDPOINT}{m}" for n in self.simplex for m in range(self.M1)]

    # ---- server ---------------------------------------------------------------------------
    def downloaded_names(self, names: list[str]) -> list[str]:
        """The endpoints and the shared parameters (batch-norm statistics with bn_buffers = global)."""
        if self.train.bn_buffers == "global":
            return names
        keep = set(self.trainable)
        return [n for n in names if n in keep]

    def init_server(self, init_params: Params) -> State:
        return {"global": make_endpoints(init_params, self.simplex, self.M1)}

    def prepare(self, server: State, clients: list[ClientSummary], seed: int = 0) -> State:
        s = self.settings
        counts = np.stack([np.asarray(c.label_counts, dtype=np.float64) for c in clients])
        plan = prepare_simplex(
            counts,
            num_endpoints=self.M1,
            num_clusters=s.num_clusters,
            rho=s.rho,
            metric=s.metric,
            algo=s.cluster_algo,
            n_init=s.n_init,
            pool_size=s.pool_size,
            seed=seed,
            eps=s.hilbert_eps,
        )
        b, E = self.train.batch_size, self.train.local_epochs
        steps = max(E * max(1, c.num_train // b) for c in clients)  # the most local steps of any client
        return {
            **server,
            "simplex": {
                "seed": seed,
                "points": torch.as_tensor(plan.points, dtype=torch.float32),
                "assignment": torch.as_tensor(plan.assignment),
                "centers": torch.as_tensor(plan.centers, dtype=torch.float32),
                "eta": plan.eta,
                "pools": torch.as_tensor(plan.pools, dtype=torch.float32),
                "num_samples": {c.client_id: c.num_train for c in clients},
                "max_steps": steps,
            },
        }

    def assigned(self, round: int) -> bool:
        """Whether clients use their subregions in ``round`` (the late start t~)."""
        return self.settings.late_start > 0 and round >= self.settings.late_start

    def center(self, server: State, client_id: int, round: int) -> torch.Tensor:
        simplex = server["simplex"]
        if not self.assigned(round):
            return self.centroid.clone()
        return simplex["centers"][int(simplex["assignment"][client_id])].clone()

    def draw_alphas(
        self, server: State, client_id: int, round: int, count: int, purpose: str = "sosicfl-alpha"
    ) -> torch.Tensor:
        """``count`` simplex points for this client and round: from its cluster's pool, or
        uniform on the simplex before the late start (a stream keyed by seed, round, client)."""
        simplex = server["simplex"]
        rng = numpy_generator(simplex["seed"], purpose, round, client_id)
        if not self.assigned(round):
            return torch.as_tensor(rng.dirichlet(np.ones(self.M1), size=count), dtype=torch.float32)
        pool = simplex["pools"][int(simplex["assignment"][client_id])]
        return pool[torch.as_tensor(rng.integers(0, len(pool), size=count))].clone()

    def omega(self, server: State) -> int:
        if self.settings.alpha_resample == "per_step":
            return int(server["simplex"]["max_steps"])
        return self.settings.samples_per_round

    def downlink(self, server: State, client_id: int, round: int) -> Payload:
        payload = {
            "global": super().downlink(server, client_id, round)["global"],
            "center": self.center(server, client_id, round),
            "alphas": self.draw_alphas(server, client_id, round, self.omega(server)),
        }
        if self.personal:
            payload["personal_alphas"] = self.draw_alphas(
                server, client_id, round, self.settings.plus_samples, "sosicfl-personal-alpha"
            )
        if self.settings.eval_samples > 1:  # before the late start: the centroid's single model
            payload["eval_alphas"] = (
                self.draw_alphas(server, client_id, round, self.settings.eval_samples, "sosicfl-eval-alpha")
                if self.assigned(round)
                else payload["center"].expand(self.settings.eval_samples, -1).clone()
            )
        return payload

    def aggregate(self, server: State, uploads: list[SentUpload], round: int) -> State:
        if self.settings.server_weights == "participants":
            return super().aggregate(server, uploads, round)
        total = float(sum(server["simplex"]["num_samples"].values()))  # Eq. 9 literally: N over all clients
        old = server["global"]
        new = {
            k: old[k] + sum((float(u["num_samples"]) / total) * (u["params"][k] - old[k]) for u in uploads)
            for k in uploads[0]["params"]
        }
        return {**server, "global": {**old, **new}}

    def global_params(self, server: State) -> Params:
        return realise(server["global"], self.simplex, self.M1, self.centroid)

    def head_update(self, server: State, upload: SentUpload) -> torch.Tensor | None:
        """The realised head's update at the centroid (total variance, SosicFL Eq. 10; for a simplex
        head a reconstruction, docs/explanations/metrics.md)."""
        new = realise(upload["params"], self.simplex, self.M1, self.centroid)
        return super().head_update({"global": self.global_params(server)}, {**upload, "params": new})

    # ---- client ---------------------------------------------------------------------------
    def init_client(self, init_params: Params, client_id: int) -> State:
        model = make_endpoints(init_params, self.simplex, self.M1)
        state = {"model": model, "center": self.centroid.clone()}
        if self.personal:
            state["personal"] = clone(model)
        if self.settings.eval_samples > 1:
            state["eval_alphas"] = self.centroid.expand(self.settings.eval_samples, -1).clone()
        return state

    def receive(self, payload: Payload, state: State, ctx: ClientContext) -> tuple[State, dict[str, Any]]:
        state = {**state, "model": {**state["model"], **clone(payload["global"])}, "center": payload["center"].clone()}
        if "eval_alphas" in payload:
            state["eval_alphas"] = payload["eval_alphas"].clone()
        if self.post_hoc:  # no personal endpoints yet: the global ones stand in (and are the start)
            state["personal"] = {**state["personal"], **clone(payload["global"])}
        return state, {}

    @property
    def post_hoc(self) -> bool:
        return self.personal and self.settings.plus_mode == "post_hoc"

    def after_receive(self, payload: Payload, state: State, ctx: ClientContext) -> tuple[State, dict[str, Any]]:
        """SosicFL+ post hoc: in the final evaluation pass every client personalises first."""
        if self.post_hoc and ctx.round > self.train.rounds:
            state, personal_loss = self.personalise(payload, state, ctx)
            return state, {"personal_loss": personal_loss}
        return state, {}

    def personalise(self, payload: Payload, state: State, ctx: ClientContext) -> tuple[State, Any]:
        """E epochs of the personal endpoints on CE at the personal alphas + lambda/2 ||theta^ - theta||^2
        toward the endpoints received this round."""
        anchor = {k: v for k, v in payload["global"].items() if k in set(self.trainable)}
        loss = simplex_loss(self.simplex, self.M1, self.settings.plus_lam)
        personal, personal_loss = self.fit_simplex(
            state["personal"],
            payload["personal_alphas"],
            ctx,
            loss,
            aux={"anchor": anchor},
            purpose="personal",
            stage="personal training",
        )
        return {**state, "personal": personal}, personal_loss

    def fit_simplex(
        self,
        params: Params,
        alphas: torch.Tensor,
        ctx: ClientContext,
        loss: LossFn,
        *,
        aux: Any = None,
        purpose: str = "train",
        epochs: int | None = None,
        stage: str = "local training",
    ) -> tuple[Params, Any]:
        step = torch.zeros(ctx.client_shape, dtype=alphas.dtype, device=alphas.device)
        fit = ctx.fit(
            {**params, ALPHAS: alphas, STEP: step},
            loss,
            aux=aux,
            trainable=self.trainable,
            carry=[STEP],
            stage=stage,
            data=TrainBatches(purpose, self.train.local_epochs if epochs is None else epochs),
        )
        return {k: v for k, v in fit.params.items() if k not in (ALPHAS, STEP)}, fit.loss

    def local_train(self, payload: Payload, state: State, ctx: ClientContext) -> Trained:
        metrics: dict[str, Any] = {}
        if self.personal and not self.post_hoc:
            state, metrics["personal_loss"] = self.personalise(payload, state, ctx)
        model, metrics["train_loss"] = self.fit_simplex(
            state["model"], payload["alphas"], ctx, simplex_loss(self.simplex, self.M1)
        )
        return {**state, "model": model}, self.upload(model, ctx), metrics

    def eval_params(self, state: State) -> Params | Ensemble:
        """The client's model at its cluster centre (SosicFL+: its personal endpoints there), or
        with ``eval_samples`` > 1 the ensemble of the models at its subregion draws."""
        endpoints = state["personal" if self.personal else "model"]
        if self.settings.eval_samples > 1:
            alphas = state["eval_alphas"]
            return Ensemble(
                realise(endpoints, self.simplex, self.M1, alphas[..., j, :]) for j in range(alphas.shape[-2])
            )
        return realise(endpoints, self.simplex, self.M1, state["center"])


@register
class SosicFLAll(SosicFL):
    """Every parametrised layer is a simplex (paper Appendix B); batch-norm statistics are shared."""

    name = "sosicfl_all"
    simplex_layers = "all"


@register
class SosicFLPlus(SosicFL):
    """SosicFL with Ditto-style personal endpoints."""

    name = "sosicfl_plus"
    personal = True
    tta_base = "ditto"


#: The SosicFL paper; the authors' code (dennis-grinwald/floco) calls the method FLOCO.
SOSICFL_PAPER = Paper(
    "Solution Simplex Clustering for Heterogeneous Federated Learning",
    "Grinwald et al.",
    2024,
    "arXiv",
    "https://arxiv.org/abs/2403.03333",
)
FLOCO = Reference(
    "dennis-grinwald/floco",
    "a25b3a1",
    (
        "src/server/floco.py (SimplexModel, SimplexLinear)",
        "src/client/floco.py",
        "src/server/fedavg.py",
        "config/cifar10_fold.yaml",
    ),
)
FLOCO_DIFFERENCES = (
    "By design, as the paper: clients are placed by LDA of their label counts and clustering. FLOCO "
    "projects the trained endpoint weights instead.",
    "Draws are exactly uniform in ball ∩ simplex. FLOCO's `_sample_L1_ball` is not uniform and leaves the simplex.",
)
SosicFL.card = MethodCard(
    full_name="SosicFL",
    paper=SOSICFL_PAPER,
    personalised=True,
    shares="The head's M + 1 = 3 endpoint tensors (and the rest of the model); the server averages them as FedAvg.",
    keeps="Nothing between rounds: its place on the simplex is the server's.",
    scored="the model at the cluster centre",
    scored_detail="Global accuracy scores the simplex centroid.",
    client_round="The head is a simplex of endpoint tensors. Before round 1 the server clusters the clients' "
    "LDA points (label counts). Each round it sends a participant the endpoints, its cluster centre and "
    "alphas drawn uniformly from its cluster's subregion. The client trains E epochs of SGD on "
    "CE(W(alpha)), with W(alpha) = Σ α_m W_m realised inside the loss (endpoint gradient α_m ∂F/∂W). "
    "Upload the endpoints.",
    references=(FLOCO,),
    tests=(
        "tests/methods/test_sosicfl.py::test_sosicfl_matches_flocos_simplex_linear_per_step_alphas_and_endpoint_average",
    ),
    differences=FLOCO_DIFFERENCES,
    choices=(
        Choice(
            "simplex size M + 1",
            "3 (not stated); 6 in the 5-Fold configs. With 3, LDA puts the 5 groups on 3 corners and clusters "
            "share one centre (MNIST 5-Fold, seeds 0-2: 3, 3, 5 distinct centres with 3 endpoints; 5, 5, 5 "
            "with 6; `python benchmarks/sosicfl_centres.py`). A run warns when two centres coincide.",
            "`sosicfl.num_endpoints`",
        ),
        Choice(
            "clustering distance",
            "L1",
            '`sosicfl.metric = "hilbert"` (boundary smoothing `sosicfl.hilbert_eps` = 1e-6), '
            '`sosicfl.cluster_algo = "kcenter"`, `sosicfl.n_init`',
        ),
        Choice("LDA", "scikit-learn online variational Bayes, M + 1 topics, seed = run seed, library defaults"),
        Choice("δ̄ (mean L1 distance from the centres to the simplex)", "Monte Carlo, 10⁵ seeded Dir(1) draws"),
        Choice(
            "sampling a subregion",
            "exact: uniform proposals on {α_i ≥ max(0, μ_i − η/2)}, accepted in the L1 ball; a pool of "
            "10,000 points per cluster",
            "`sosicfl.pool_size`",
        ),
        Choice(
            "alphas",
            "a fresh draw per local step (the paper's §3.2 step 2, and FLOCO's code)",
            '`sosicfl.alpha_resample = "per_round"` (Ω_tr draws per client and round that the steps cycle '
            "over; Appendix A's Ω_tr = 1: one α per round), `sosicfl.samples_per_round`",
        ),
        Choice(
            "server weights",
            "N_k over the round's participants",
            '`sosicfl.server_weights = "literal"` (N over all clients, the paper\'s formula)',
        ),
        Choice(
            "endpoint initialisation",
            "every weight endpoint an independent Xavier-normal draw, as FLOCO's code; 1-d tensors "
            "(`simplex_bias`): endpoint 0 the initial value, the others + N(0, 0.01); keyed by the initial tensor",
        ),
        Choice("biases", "one shared bias", "`sosicfl.simplex_bias`"),
        Choice(
            "late start t~",
            "1 (clusters from the start)",
            "`sosicfl.late_start` (0 = never: plain simplex FedAvg, scored at the centroid)",
        ),
        Choice(
            "Ω_te (models per client at inference)",
            "1: the single model at the cluster centre (the paper's setting)",
            "`sosicfl.eval_samples` > 1: the softmax ensemble of models at that many subregion draws",
        ),
    ),
    notes=("Every SosicFL config uses weight decay 5e-4: docs/explanations/reconstructions.md.",),
    reconstruction=True,
)
SosicFLAll.card = MethodCard(
    full_name="SosicFL-All",
    paper=SOSICFL_PAPER,
    personalised=True,
    shares="Every parametrised layer's endpoints; batch-norm statistics are shared as in FedAvg.",
    keeps="Nothing between rounds.",
    scored="the model at the cluster centre",
    scored_detail="Global accuracy scores the simplex centroid.",
    client_round="As SosicFL, with every parametrised layer's weights a simplex. Its choices are "
    "SosicFL's ([sosicfl](sosicfl.md)).",
    references=(FLOCO,),
    tests=(
        "tests/methods/test_sosicfl.py::test_sosicfl_matches_flocos_simplex_linear_per_step_alphas_and_endpoint_average",
    ),
    differences=FLOCO_DIFFERENCES,
)
SosicFLPlus.card = MethodCard(
    full_name="SosicFL+",
    paper=SOSICFL_PAPER,
    personalised=True,
    shares="The shared endpoints, as SosicFL.",
    keeps="Its personal endpoints.",
    scored="the personal endpoints at the cluster centre",
    scored_detail="Global accuracy scores the shared endpoints at the centroid.",
    client_round="As SosicFL, plus personal endpoints per client, trained first each round like Ditto's "
    "personal model: E epochs on CE at alphas cycling over 10 subregion draws + λ/2‖θ̂ − θ‖² toward the "
    "received endpoints (λ = 1). Its other choices are SosicFL's ([sosicfl](sosicfl.md)).",
    references=(FLOCO,),
    tests=("tests/methods/test_sosicfl_plus.py::test_sosicfl_plus_matches_floco_plus_at_its_default_lambda",),
    pinned=(
        "tests/methods/test_sosicfl_plus.py::test_sosicfl_plus_regulariser_at_lambda_one_half_as_flocos_code",
        "tests/methods/test_sosicfl_plus.py::test_sosicfl_plus_scores_the_personal_endpoints_at_the_centroid_as_flocos_code",
    ),
    differences=(
        *FLOCO_DIFFERENCES,
        "FLOCO+ adds λθ̂ − θ to the gradient (operator precedence). This equals pflkit's λ(θ̂ − θ) at the default λ = 1.",
        "FLOCO+'s personal model never receives the subregion: it trains at uniform draws and is scored at "
        "the centroid. pflkit uses subregion draws and the cluster centre, as the paper.",
    ),
    choices=(
        Choice(
            "λ, personal draws, schedule",
            "1.0, Ω_tr = 10, every participation",
            '`sosicfl.plus_lam`, `sosicfl.plus_samples`, `sosicfl.plus_mode = "post_hoc"` (after SosicFL '
            "training, every client fine-tunes personal endpoints from the final global ones in the final "
            "evaluation; until then clients are scored with the global endpoints at their centre)",
        ),
    ),
    reconstruction=True,
)

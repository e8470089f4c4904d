"""SosicFL's preparation stage on the server (SosicFL paper, Section 3.3): the clients' label
counts become points on the simplex Δ^M (LDA), the points are clustered (L1 or Hilbert metric),
and every cluster gets a subregion (an L1 ball of radius eta = rho * mean distance to the simplex,
cut to the simplex) with an exact uniform sampler; and the simplex parametrisation W(alpha) =
sum_m alpha_m W_m of the model's endpoint tensors.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

log = logging.getLogger(__name__)

Metric = Literal["l1", "hilbert"]
ENDPOINT = "@"  # endpoint m of parameter "name" is stored as "name@m"


class SimplexError(ValueError):
    """A SosicFL setting that cannot work on this data (names the setting)."""


# ---- the simplex parametrisation ------------------------------------------------------------
def endpoint_name(name: str, m: int) -> str:
    return f"{name}{ENDPOINT}{m}"


def make_endpoints(params: Mapping[str, torch.Tensor], names: list[str], num_endpoints: int) -> dict[str, torch.Tensor]:
    """``params`` with each of ``names`` replaced by ``num_endpoints`` independently initialised
    endpoint tensors, all drawn the same way as FLOCO's code does (every endpoint an
    independent Xavier-normal draw): a weight's endpoint m is Xavier-normal from a generator keyed
    by the initial tensor's bytes and m; a 1-d tensor (``simplex_bias``) keeps its initial value
    as endpoint 0 and adds N(0, 0.1^2) noise for the others. Every engine, Flower node and resumed
    run thus builds the same endpoints from the same initial model, which the run seed fixes."""
    out = {k: v for k, v in params.items() if k not in names}
    for name in names:
        base = params[name]
        key = hashlib.sha256(base.detach().cpu().contiguous().numpy().tobytes()).digest()
        for m in range(num_endpoints):
            if m == 0 and base.dim() < 2:
                out[endpoint_name(name, m)] = base.detach().clone()
                continue
            g = torch.Generator().manual_seed(int.from_bytes(key[:7], "little") + m)
            if base.dim() >= 2:
                fan_out, fan_in = base.shape[0], base[0].numel()
                std = (2.0 / (fan_in + fan_out)) ** 0.5
                value = torch.randn(base.shape, generator=g) * std
            else:
                value = base.detach().cpu() + 0.1 * torch.randn(base.shape, generator=g)
            out[endpoint_name(name, m)] = value.to(base.device, base.dtype)
    return out


def realise(
    params: Mapping[str, torch.Tensor], names: list[str], num_endpoints: int, alpha: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The ordinary parameter dict at simplex point ``alpha``: W = sum_m alpha_m W_m for each of
    ``names``, other entries as they are. ``alpha`` [M+1], or [K, M+1] with every tensor carrying
    a leading client dimension (batched contexts). Differentiable: the gradient reaching W_m is
    alpha_m times the realised weights' gradient."""
    out = {k: v for k, v in params.items() if ENDPOINT not in k}
    lead = alpha.dim() - 1
    for name in names:
        total = None
        for m in range(num_endpoints):
            w = params[endpoint_name(name, m)]
            coef = alpha[..., m].reshape(alpha.shape[:-1] + (1,) * (w.dim() - lead)).to(w.device, w.dtype)
            total = coef * w if total is None else total + coef * w
        assert total is not None  # (num_endpoints >= 1)
        out[name] = total
    return out


# ---- stage 1: LDA points ------------------------------------------------------------------
def lda_points(counts: np.ndarray, num_endpoints: int, seed: int) -> np.ndarray:
    """Each client's point on Δ^M from its label counts [K, L]: scikit-learn's online variational
    Bayes LDA with M + 1 topics (library defaults otherwise)."""
    from sklearn.decomposition import LatentDirichletAllocation

    counts = np.asarray(counts, dtype=np.float64)
    labels = counts.shape[1]
    if num_endpoints >= labels:
        raise SimplexError(
            f"sosicfl.num_endpoints={num_endpoints} needs fewer simplex endpoints than the "
            f"dataset's {labels} labels (LDA with M + 1 topics needs M + 1 < L)"
        )
    lda = LatentDirichletAllocation(n_components=num_endpoints, learning_method="online", random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=UserWarning)
        points = lda.fit_transform(counts)
    return points / points.sum(1, keepdims=True)


# ---- stage 2: clustering on the simplex ---------------------------------------------------
def smooth(p: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Move boundary points into the open simplex: (p + eps) / (1 + (M+1) eps)."""
    return (p + eps) / (1 + p.shape[-1] * eps)


def distances(a: np.ndarray, b: np.ndarray, metric: Metric, eps: float = 1e-6) -> np.ndarray:
    """Pairwise distances [len(a), len(b)]: L1, or the Hilbert simplex metric
    log(max_i p_i/q_i / min_j p_j/q_j) on smoothed points."""
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    if metric == "l1":
        return np.abs(a[:, None, :] - b[None, :, :]).sum(-1)
    if metric == "hilbert":
        diff = np.log(smooth(a, eps))[:, None, :] - np.log(smooth(b, eps))[None, :, :]
        return diff.max(-1) - diff.min(-1)
    raise SimplexError(f"sosicfl.metric must be 'l1' or 'hilbert', got {metric!r}")


def one_center(points: np.ndarray, metric: Metric, steps: int = 100, eps: float = 1e-6) -> np.ndarray:
    """Bădoiu-Clarkson walk toward the farthest member, from the mean (stays in the simplex)."""
    c = points.mean(0)
    for j in range(1, steps + 1):
        far = points[int(np.argmax(distances(c, points, metric, eps)[0]))]
        c = c + (far - c) / (j + 1)
    return c


@dataclass
class Clustering:
    assignment: np.ndarray  # [K] cluster of each client
    centers: np.ndarray  # [C, M+1]
    cost: float


def cluster(
    points: np.ndarray,
    num_clusters: int,
    metric: Metric = "l1",
    algo: str = "kmeans",
    n_init: int = 10,
    max_iter: int = 100,
    seed: int = 0,
    eps: float = 1e-6,
) -> Clustering:
    """Center-based clustering of simplex points: k-means++ or k-center
    (farthest-first) seeding, Lloyd iterations with the metric's center, ``n_init`` restarts,
    the lowest cost kept. Fewer distinct points than ``num_clusters`` reduce it (warned).
    ``eps``: the Hilbert metric's boundary smoothing."""
    if num_clusters < 1:
        raise SimplexError(f"sosicfl.num_clusters must be >= 1, got {num_clusters}")
    if algo not in ("kmeans", "kcenter"):
        raise SimplexError(f"sosicfl.cluster_algo must be 'kmeans' or 'kcenter', got {algo!r}")
    distinct = np.unique(np.round(points, 12), axis=0)
    if len(distinct) < num_clusters:
        log.warning(
            "sosicfl: %d clusters asked but the clients have only %d distinct LDA points; using %d",
            num_clusters,
            len(distinct),
            len(distinct),
        )
        num_clusters = len(distinct)
    rng = np.random.default_rng(seed)
    best: Clustering | None = None
    for _ in range(max(1, n_init)):
        centers = _seed_centers(points, num_clusters, metric, algo, rng, eps)
        assignment = np.full(len(points), -1)
        for _ in range(max_iter):
            new = np.argmin(distances(points, centers, metric, eps), axis=1)
            if np.array_equal(new, assignment):
                break
            assignment = new
            for c in range(num_clusters):
                members = points[assignment == c]
                if len(members) == 0:  # re-seed at the point farthest from its own center
                    own = distances(points, centers, metric, eps)[np.arange(len(points)), assignment]
                    centers[c] = points[int(np.argmax(own))]
                elif algo == "kmeans" and metric == "l1":
                    centers[c] = members.mean(0)
                else:
                    centers[c] = one_center(members, metric, eps=eps)
        d = distances(points, centers, metric, eps)[np.arange(len(points)), assignment]
        cost = float(d.max() if algo == "kcenter" else (d**2).sum())
        if best is None or cost < best.cost - 1e-12:
            best = Clustering(assignment.copy(), centers.copy(), cost)
    assert best is not None
    return best


def _seed_centers(
    points: np.ndarray, k: int, metric: Metric, algo: str, rng: np.random.Generator, eps: float = 1e-6
) -> np.ndarray:
    centers = [points[int(rng.integers(len(points)))]]
    for _ in range(1, k):
        d = distances(points, np.array(centers), metric, eps).min(1)
        if algo == "kcenter":
            centers.append(points[int(np.argmax(d))])
        else:
            weights = d**2
            total = weights.sum()
            i = int(rng.choice(len(points), p=weights / total)) if total > 0 else int(rng.integers(len(points)))
            centers.append(points[i])
    return np.array(centers, dtype=np.float64)


# ---- stage 3: subregions and their uniform sampler ---------------------------------------
def mean_distance_to_simplex(centers: np.ndarray, draws: int = 100_000, seed: int = 0) -> float:
    """delta-bar: mean over centers of E_{a ~ U(Δ^M)} ||mu_c - a||_1, by seeded Monte Carlo."""
    rng = np.random.default_rng(seed)
    a = rng.dirichlet(np.ones(centers.shape[1]), size=draws)
    return float(np.mean([np.abs(a - c).sum(1).mean() for c in centers]))


def sample_region(
    center: np.ndarray, eta: float, n: int, rng: np.random.Generator, max_proposals: int = 100_000_000
) -> np.ndarray:
    """``n`` points uniform on {a in Δ^M : ||a - center||_1 <= eta}: uniform proposals
    on the scaled simplex {a_i >= max(0, mu_i - eta/2)}, which contains the region, accepted
    when inside the ball (exact)."""
    if not eta > 0:
        raise SimplexError(f"the subregion radius must be > 0 (sosicfl.rho > 0), got {eta}")
    low = np.maximum(0.0, center - eta / 2)
    scale = 1.0 - low.sum()
    out: list[np.ndarray] = []
    got, proposed = 0, 0
    while got < n:
        batch = max(1024, 2 * (n - got))
        a = low + scale * rng.dirichlet(np.ones(len(center)), size=batch)
        keep = a[np.abs(a - center).sum(1) <= eta]
        out.append(keep)
        got += len(keep)
        proposed += batch
        if proposed > max_proposals:
            raise SimplexError(
                f"sampling the subregion of radius {eta:.3g} accepted {got} of {proposed} "
                "proposals; raise sosicfl.rho or lower sosicfl.num_endpoints"
            )
    return np.concatenate(out)[:n]


@dataclass
class SimplexPlan:
    """The server's preparation: clients' points, clusters, radius and each cluster's pool."""

    points: np.ndarray
    assignment: np.ndarray
    centers: np.ndarray
    eta: float
    pools: np.ndarray  # [C, P, M+1]


def coincident_centres(centers: np.ndarray, tol: float = 1e-3) -> list[tuple[int, int]]:
    """Pairs of cluster centres closer than ``tol`` (L1): clusters that would share a subregion."""
    return [
        (i, j)
        for i in range(len(centers))
        for j in range(i + 1, len(centers))
        if np.abs(centers[i] - centers[j]).sum() < tol
    ]


def prepare_simplex(
    counts: np.ndarray,
    *,
    num_endpoints: int,
    num_clusters: int,
    rho: float,
    metric: Metric,
    algo: str,
    n_init: int,
    pool_size: int,
    seed: int,
    eps: float = 1e-6,
) -> SimplexPlan:
    """The preparation stage (LDA points, clusters, subregions) from the clients' label counts [K, L]."""
    if not rho > 0:
        raise SimplexError(f"sosicfl.rho must be > 0, got {rho}")
    points = lda_points(counts, num_endpoints, seed)
    clusters = cluster(points, num_clusters, metric, algo, n_init, seed=seed, eps=eps)
    for i, j in coincident_centres(clusters.centers):
        log.warning(
            "sosicfl: clusters %d and %d share one centre %s: clients of different label distributions "
            "share a subregion. With M + 1 = %d endpoints LDA cannot place %d clusters apart; raise "
            "sosicfl.num_endpoints (5-Fold needs 6 on MNIST)",
            i,
            j,
            np.round(clusters.centers[i], 3),
            num_endpoints,
            num_clusters,
        )
    eta = rho * mean_distance_to_simplex(clusters.centers, seed=seed)
    rng = np.random.default_rng(seed)
    pools = np.stack([sample_region(c, eta, pool_size, rng) for c in clusters.centers])
    return SimplexPlan(points, clusters.assignment, clusters.centers, eta, pools)

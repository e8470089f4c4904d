"""SosicFL's pictures of a finished run: the clients on the simplex with their clusters and
subregions, and the accuracy landscape of chosen clients over uniform simplex points (Fig. 5)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..algorithms.simplex import realise
from ..algorithms.sosicfl import SosicFL
from ..data.federated import FederatedData
from ..federation import ResultsFolder, initial_params, partition_seed
from ..federation.checkpoint import load_checkpoint
from ..federation.preparation import build_partitions, resolve_device
from ..functional import forward
from ..methods import build_algorithm
from ..reporting import plot_simplex_clusters, plot_simplex_landscape


@dataclass
class SimplexRun:
    """A finished SosicFL run rebuilt from its folder: the checkpoint's state, the seed's
    partition, the model and the algorithm object that trained it."""

    results: ResultsFolder
    seed: int
    state: Any
    data: FederatedData
    model: torch.nn.Module
    alg: SosicFL


def load_simplex_run(run: str | Path, algorithm: str = "sosicfl", seed: int | None = None) -> SimplexRun:
    """Load ``algorithm``'s run at ``seed`` (default: the config's first seed) from the results
    folder ``run``; a clear error when the run, its checkpoint or its simplex is missing."""
    results = ResultsFolder(run)
    config = results.load_config()
    if algorithm not in config.algorithms:
        raise ValueError(f"{results.root} has no {algorithm!r} run; it ran {', '.join(config.algorithms)}")
    seed = config.seeds[0] if seed is None else seed
    ckpt = results.checkpoint_path(algorithm, seed)
    if not ckpt.is_file():
        raise ValueError(
            f"{results.root} has no checkpoint of {algorithm} seed {seed} ({ckpt.name}; "
            "checkpoints stay on the machine that ran it)"
        )
    state = load_checkpoint(ckpt)
    if "simplex" not in state.server:
        raise ValueError(f"{algorithm} is not a SosicFL method: its run has no simplex")
    config, partitions = build_partitions(config.model_copy(update={"seeds": [seed]}), resolve_device("cpu"))
    data = partitions[partition_seed(config, seed)]
    model, _ = initial_params(config, data, seed, resolve_device("cpu"))
    alg = build_algorithm(algorithm, config.algorithm_sections(), config.train, model.units())
    assert isinstance(alg, SosicFL)
    return SimplexRun(results, seed, state, data, model, alg)


def simplex_pictures(
    run: str | Path,
    algorithm: str = "sosicfl",
    seed: int | None = None,
    clients: list[int] | None = None,
    points: int = 2000,
) -> list[Path]:
    """Draw ``plots/simplex-<algorithm>.png`` and ``plots/landscape-<algorithm>.png`` of the run
    in folder ``run`` from its checkpoint: the landscape scores each chosen client's model
    (SosicFL: the global endpoints; SosicFL+: the client's personal endpoints) on its local test
    set at ``points`` uniform simplex points (default clients: one per cluster, at most three)."""
    loaded = load_simplex_run(run, algorithm, seed)
    results, seed, state, data, model, alg = (
        loaded.results,
        loaded.seed,
        loaded.state,
        loaded.data,
        loaded.model,
        loaded.alg,
    )
    simplex = state.server["simplex"]
    assignment = simplex["assignment"].numpy()
    out: list[Path] = []
    clusters_png = results.plots / f"simplex-{algorithm}.png"
    if plot_simplex_clusters(
        simplex["points"].numpy(),
        assignment,
        simplex["centers"].numpy(),
        simplex["pools"].numpy(),
        clusters_png,
        f"{algorithm}: clients and subregions",
    ):
        out.append(clusters_png)
    if clients is None:
        clients = [int(np.flatnonzero(assignment == c)[0]) for c in np.unique(assignment)[:3]]
    alphas = torch.as_tensor(np.random.default_rng(seed).dirichlet(np.ones(alg.M1), size=points), dtype=torch.float32)
    for cid in clients:
        if not 0 <= cid < data.num_clients:
            raise ValueError(f"client {cid} does not exist (the run has {data.num_clients} clients)")
    # Fig. 5, left: the global endpoints on the global test set (the official split, or else the
    # clients' pooled test splits), the centroid marked
    if data.global_test is not None:
        global_x, global_y = data.global_test
        where = "global test set"
    else:
        global_x = torch.cat([c.test_x for c in data.clients])
        global_y = torch.cat([c.test_y for c in data.clients])
        where = "pooled client test sets"
    accuracy = {"global model": landscape(model, alg, state.server["global"], alphas, global_x, global_y)}
    centers = {"global model": alg.centroid.numpy()}
    labels = {"global model": f"accuracy on the {where} (%)"}
    lda_points = {}
    for cid in clients:  # Fig. 5, right: each client's model on its local test set
        own = state.clients.get(cid, {})
        params = own["personal"] if alg.personal and "personal" in own else state.server["global"]
        label = f"client {cid} (cluster {int(assignment[cid])})"
        accuracy[label] = landscape(model, alg, params, alphas, data.clients[cid].test_x, data.clients[cid].test_y)
        centers[label] = alg.center(state.server, cid, state.rounds_done).numpy()
        lda_points[label] = simplex["points"][cid].numpy()
    landscape_png = results.plots / f"landscape-{algorithm}.png"
    if plot_simplex_landscape(
        alphas.numpy(),
        accuracy,
        centers,
        landscape_png,
        f"{algorithm}: accuracy over {points} simplex points (round {state.rounds_done})",
        points=lda_points,
        labels=labels,
    ):
        out.append(landscape_png)
    return out


def landscape(
    model: torch.nn.Module,
    alg: SosicFL,
    params: dict[str, torch.Tensor],
    alphas: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
) -> np.ndarray:
    """Accuracy of the model at each simplex point ``alphas`` on (x, y)."""
    head = len(alg.units) - 1
    hits = []
    with torch.no_grad():
        if alg.simplex_layers == "head":  # the body is shared: its features once, the head per point
            inputs, start = (
                forward(model, realise(params, alg.simplex, alg.M1, alphas[0]), x, stop=head, train=False),
                head,
            )
        else:
            inputs, start = x, 0
        for alpha in alphas:
            logits = forward(model, realise(params, alg.simplex, alg.M1, alpha), inputs, start=start, train=False)
            hits.append(float((logits.argmax(1) == y).float().mean()))
    return np.array(hits)

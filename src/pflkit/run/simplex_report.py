"""SosicFL's pictures of a finished run: the clients on the simplex with their clusters and
subregions, and the accuracy landscape of chosen clients over uniform simplex points (Fig. 5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..algorithms import build_algorithm
from ..algorithms.context import TrainSettings
from ..algorithms.simplex import realise
from ..algorithms.sosicfl import SosicFL
from ..config import load_config
from ..federation import ResultsFolder, initial_params, partition_seed
from ..federation.checkpoint import load_checkpoint
from ..federation.setup import build_partitions, resolve_device
from ..functional import forward
from ..reporting import plot_simplex_clusters, plot_simplex_landscape


def simplex_pictures(run: str | Path, algorithm: str = "sosicfl", seed: int | None = None,
                     clients: list[int] | None = None, points: int = 2000) -> list[Path]:
    """Draw ``plots/simplex-<algorithm>.png`` and ``plots/landscape-<algorithm>.png`` of the run
    in folder ``run`` from its checkpoint: the landscape scores each chosen client's model
    (SosicFL: the global endpoints; SosicFL+: the client's personal endpoints) on its local test
    set at ``points`` uniform simplex points (default clients: one per cluster, at most three)."""
    results = ResultsFolder(run)
    config = load_config(results.config_path)
    if algorithm not in config.algorithms:
        raise ValueError(f"{results.root} has no {algorithm!r} run; it ran {', '.join(config.algorithms)}")
    seed = config.seeds[0] if seed is None else seed
    ckpt = results.checkpoint_path(algorithm, seed)
    if not ckpt.is_file():
        raise ValueError(f"{results.root} has no checkpoint of {algorithm} seed {seed} ({ckpt.name})")
    state = load_checkpoint(ckpt)
    if "simplex" not in state.server:
        raise ValueError(f"{algorithm} is not a SosicFL method: its run has no simplex")
    simplex = state.server["simplex"]
    assignment = simplex["assignment"].numpy()
    out: list[Path] = []
    clusters_png = results.plots / f"simplex-{algorithm}.png"
    if plot_simplex_clusters(simplex["points"].numpy(), assignment, simplex["centers"].numpy(),
                             simplex["pools"].numpy(), clusters_png, f"{algorithm}: clients and subregions"):
        out.append(clusters_png)
    device = resolve_device("cpu")
    config, partitions = build_partitions(config.model_copy(update={"seeds": [seed]}), device)
    data = partitions[partition_seed(config, seed)]
    model, _ = initial_params(config, data, seed, device)
    alg = build_algorithm(algorithm, config.algorithm_sections(), TrainSettings.from_config(config), model.units())
    assert isinstance(alg, SosicFL)
    if clients is None:
        clients = [int(np.flatnonzero(assignment == c)[0]) for c in np.unique(assignment)[:3]]
    alphas = torch.as_tensor(np.random.default_rng(seed).dirichlet(np.ones(alg.M1), size=points), dtype=torch.float32)
    accuracy, centers = {}, {}
    for cid in clients:
        if not 0 <= cid < data.num_clients:
            raise ValueError(f"client {cid} does not exist (the run has {data.num_clients} clients)")
        own = state.clients.get(cid, {})
        params = own["personal"] if alg.personal and "personal" in own else state.server["global"]
        test_x, test_y = data.clients[cid].test_x, data.clients[cid].test_y
        head = len(alg.units) - 1
        hits = []
        with torch.no_grad():
            if alg.simplex_layers == "head":  # the body is shared: its features once, the head per point
                inputs, start = forward(model, realise(params, alg.simplex, alg.M1, alphas[0]), test_x,
                                        stop=head, train=False), head
            else:
                inputs, start = test_x, 0
            for alpha in alphas:
                logits = forward(model, realise(params, alg.simplex, alg.M1, alpha), inputs, start=start, train=False)
                hits.append(float((logits.argmax(1) == test_y).float().mean()))
        label = f"client {cid} (cluster {int(assignment[cid])})"
        accuracy[label] = np.array(hits)
        centers[label] = alg.center(state.server, cid, state.rounds_done).numpy()
    landscape_png = results.plots / f"landscape-{algorithm}.png"
    if plot_simplex_landscape(alphas.numpy(), accuracy, centers, landscape_png,
                              f"{algorithm}: accuracy over {points} simplex points (round {state.rounds_done})"):
        out.append(landscape_png)
    return out

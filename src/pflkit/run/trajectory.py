"""``pflkit plot trajectory``: a traced client's models over the rounds, projected on their first
two principal components (scikit-learn PCA), over the client's training-loss surface on that plane
(FedALA Fig. 4: the local model's path with and without ALA)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from sklearn.decomposition import PCA
from torch.nn import functional as F

from ..federation import ResultsFolder, initial_params, partition_seed
from ..federation.preparation import build_partitions, resolve_device
from ..functional import forward
from ..reporting.plots import plot_trajectory


def load_trace(folder: Path, client: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
    pattern = re.compile(rf"client{client}-round(\d+)\.pt$")
    found = sorted(
        (int(m.group(1)), p) for p in folder.glob(f"client{client}-round*.pt") if (m := pattern.search(p.name))
    )
    return [(r, load_traced_model(p)) for r, p in found]


def load_traced_model(path: Path) -> dict[str, torch.Tensor]:
    """One saved model of a traced client: tensors only (a file that holds anything else, such as
    code in its pickle, is refused with its name)."""
    try:
        params = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a tampered or truncated file: one line, whatever torch raises
        raise ValueError(
            f"trace file {path} is not a model pflkit saved ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'}); remove it"
        ) from None
    if not isinstance(params, dict) or not all(isinstance(v, torch.Tensor) for v in params.values()):
        raise ValueError(f"trace file {path} holds no parameter dict; remove it")
    return params


def trajectory_picture(
    run: str | Path, client: int, seed: int | None = None, grid: int = 15, samples: int = 500
) -> Path:
    """Draw ``plots/trajectory-client<i>.png`` from the run's ``trace/`` folder: every traced
    algorithm's path of client ``client``'s model, on one PCA plane, over the client's training loss
    (at most ``samples`` of its training samples) on a ``grid`` × ``grid`` lattice of that plane."""
    results = ResultsFolder(run)
    config = results.load_config()
    seed = config.seeds[0] if seed is None else seed
    traces = {}
    for algorithm in config.algorithms:
        steps = load_trace(results.root / "trace" / f"{algorithm}-seed{seed}", client)
        if steps:
            traces[algorithm] = steps
    if not traces:
        raise ValueError(
            f"{results.root} has no trace of client {client} (seed {seed}); run with 'trace.clients=[{client}]'"
        )
    names = sorted(next(iter(traces.values()))[0][1])
    names = [n for n in names if n.endswith(("weight", "bias")) and "running" not in n]
    flat = {
        a: np.stack([torch.cat([p[n].flatten() for n in names]).numpy() for _, p in steps])
        for a, steps in traces.items()
    }
    points = np.concatenate(list(flat.values()))
    pca = PCA(n_components=2, random_state=0).fit(points)
    paths = {a: pca.transform(v) for a, v in flat.items()}
    device = resolve_device("cpu")
    config, partitions = build_partitions(config.model_copy(update={"seeds": [seed]}), device)
    data = partitions[partition_seed(config, seed)]
    model, _ = initial_params(config, data, seed, device)
    x, y = data.clients[client].train_x[:samples], data.clients[client].train_y[:samples]
    template = next(iter(traces.values()))[-1][1]
    shapes = [(n, template[n].shape, template[n].numel()) for n in names]
    projected = np.concatenate(list(paths.values()))
    low, high = projected.min(0), projected.max(0)
    pad = 0.2 * np.maximum(high - low, 1e-3)
    a_axis = np.linspace(low[0] - pad[0], high[0] + pad[0], grid)
    b_axis = np.linspace(low[1] - pad[1], high[1] + pad[1], grid)
    surface = np.zeros((grid, grid))
    with torch.no_grad():
        for i, b in enumerate(b_axis):
            for j, a in enumerate(a_axis):
                vector = torch.as_tensor(pca.inverse_transform(np.array([[a, b]]))[0], dtype=torch.float32)
                params, start = dict(template), 0
                for name, shape, size in shapes:
                    params[name] = vector[start : start + size].view(shape)
                    start += size
                surface[i, j] = float(F.cross_entropy(forward(model, params, x, train=False), y))
    path = results.plots / f"trajectory-client{client}.png"
    plot_trajectory(
        paths,
        {a: [r for r, _ in s] for a, s in traces.items()},
        a_axis,
        b_axis,
        surface,
        pca.explained_variance_ratio_,
        path,
        f"client {client}: models over rounds (seed {seed})",
    )
    return path

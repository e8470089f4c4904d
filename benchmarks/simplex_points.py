"""Where on its simplex a finished SosicFL run's global endpoints make a good model: accuracy on
the global test set at the centroid (the run's global model), the mean of the cluster centres,
each cluster centre and each vertex, with the centres' L1 distance from the centroid beside the
subregion radius eta. The measurement behind docs/papers/sosicfl.md's 5-Fold and Dir(0.5) paragraphs
(why SosicFL-All's 5-Fold global model fails, and that SosicFL's does not).

    PFLKIT_DATA=../shared/datasets python benchmarks/simplex_points.py \\
        "docs/results/sosicfl-mnist-5fold/algorithms=sosicfl_all,seeds=0" sosicfl_all 0

Needs the run's checkpoint (``checkpoints/<algorithm>-seed<seed>.pt``, kept by ``checkpoint_every``
and git-ignored: run it where the cell ran).
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import torch

from pflkit.run.simplex_report import landscape, load_simplex_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the cell's results folder")
    parser.add_argument("algorithm", help="sosicfl, sosicfl_all or sosicfl_plus")
    parser.add_argument("seed", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("pflkit").setLevel(logging.ERROR)
    try:
        loaded = load_simplex_run(args.run, args.algorithm, args.seed)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    state, data, model, alg = loaded.state, loaded.data, loaded.model, loaded.alg
    if data.global_test is None:
        raise SystemExit(f"{args.run}: the run has no global test set (test_set = 'official' needed)")
    simplex = state.server["simplex"]
    centres = simplex["centers"]
    print(f"round {state.rounds_done}; clients per cluster {np.bincount(simplex['assignment'].numpy()).tolist()}")
    print("cluster centres:\n", np.round(centres.numpy(), 3))
    distance = (centres - alg.centroid).abs().sum(1)
    print(f"L1 distance centroid -> centres {[round(float(d), 3) for d in distance]}; eta {simplex['eta']:.3f}")
    points = {"centroid (global model)": alg.centroid, "mean of the centres": centres.mean(0)}
    points |= {f"centre {c}": centres[c] for c in range(len(centres))}
    points |= {f"vertex {m}": torch.eye(alg.M1)[m] for m in range(alg.M1)}
    x, y = data.global_test
    accuracy = landscape(model, alg, state.server["global"], torch.stack(list(points.values())), x, y)
    for name, value in zip(points, accuracy):
        print(f"{name:24s} {100 * value:6.2f} %")


if __name__ == "__main__":
    main()

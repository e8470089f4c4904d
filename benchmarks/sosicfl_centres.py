"""How many distinct SosicFL cluster centres LDA gives on MNIST 5-Fold for each simplex size: the
measurement behind the 5-Fold configs' num_endpoints = 6.

    python benchmarks/sosicfl_centres.py --data-dir ../shared/datasets/mnist

100 clients in 5 groups (80 % of each client's data from its group's two primary classes), C = 5
clusters, rho = 0.4; for M + 1 = 3..6 endpoints and partition seeds 0-2, prints the number of
distinct centres (rounded to 3 decimals). Fewer than 5 means groups with different primary
classes share a subregion.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import torch

from pflkit.algorithms.simplex import prepare_simplex
from pflkit.config import load_config
from pflkit.data import load_dataset
from pflkit.federation import partition_dataset, partition_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("pflkit").setLevel(logging.ERROR)  # the coincident-centre warnings are the point here
    config = load_config(
        "configs/sosicfl_mnist.toml",
        [f"data_dir='{args.data_dir}'", "num_folds=5", "sosicfl.num_clusters=5", "sosicfl.rho=0.4"],
    )
    dataset = load_dataset("mnist", args.data_dir, official_test=True)
    for seed in range(args.seeds):
        data = partition_dataset(config, dataset, partition_seed(config, seed), torch.device("cpu"))
        counts = np.stack([data.train_label_counts(i) for i in range(data.num_clients)]).astype(float)
        row = []
        for endpoints in (3, 4, 5, 6):
            plan = prepare_simplex(
                counts,
                num_endpoints=endpoints,
                num_clusters=5,
                rho=0.4,
                metric="l1",
                algo="kmeans",
                n_init=10,
                pool_size=100,
                seed=seed,
            )
            row.append(f"M+1={endpoints}: {len({tuple(c) for c in np.round(plan.centers, 3)})}")
        print(f"seed {seed}: distinct centres  " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()

"""The papers' published numbers (best accuracy %, mean over their five runs; SosicFL's Table 5
time-to-accuracy improvements with its Tables 2 and 3 cells), for reports that set ours beside
them. A config names its cell with ``paper_table = "<table>/<column>"``.

Sources: FedALA (AAAI 2023, arXiv 2212.01197) Tables 1 and 6 (s and p sweeps), 2, 3 (cost), 4 and 7;
SosicFL (arXiv 2403.03333) Tables 2, 3 (which columns the Ditto/SosicFL+ rows fill is our reading of
the paper's flattened table text) and Table 5 (time-to-accuracy improvements, global then local, same
column reading); PFLlib's benchmark page (``docs/benchmark.html`` at PFLlib d832e76), FMNIST in its
practical label skew setting, for the methods pflkit holds under their pflkit names.
"""

from __future__ import annotations

from typing import Any

_FEDALA_T2_COLUMNS = (
    "mnist-pathological",
    "cifar10-pathological",
    "cifar100-pathological",
    "cifar10-dir0.1",
    "cifar100-dir0.1",
    "tiny-dir0.1",
    "tiny-resnet18-dir0.1",
    "agnews-dir0.1",
)
_FEDALA_T2 = {
    "fedavg": (97.93, 55.09, 25.98, 59.16, 31.89, 19.46, 19.45, 79.57),
    "fedprox": (98.01, 55.06, 25.94, 59.21, 31.99, 19.37, 19.27, 79.35),
    "fedavgc": (99.79, 92.13, 66.17, 90.34, 51.80, 30.67, 36.94, 95.89),
    "fedproxc": (99.80, 92.12, 66.07, 90.33, 51.84, 30.77, 38.78, 96.10),
    "perfedavg": (99.63, 89.63, 56.80, 87.74, 44.28, 25.07, 21.81, 93.27),
    "fedrep": (99.77, 91.93, 67.56, 90.40, 52.39, 37.27, 39.95, 96.28),
    "pfedme": (99.75, 90.11, 58.20, 88.09, 47.34, 26.93, 33.44, 91.41),
    "ditto": (99.81, 92.39, 67.23, 90.59, 52.87, 32.15, 35.92, 95.45),
    "fedamp": (99.76, 90.79, 64.34, 88.70, 47.69, 27.99, 29.11, 94.18),
    "fedphp": (99.73, 90.01, 63.09, 88.92, 50.52, 35.69, 29.90, 94.38),
    "fedfomo": (99.83, 91.85, 62.49, 88.06, 45.39, 26.33, 26.84, 95.84),
    "apple": (99.75, 90.97, 65.80, 89.37, 53.22, 35.04, 39.93, 95.63),
    "partialfed": (99.86, 89.60, 61.39, 87.38, 48.81, 35.26, 37.50, 85.20),
    "fedala": (99.88, 92.44, 67.83, 90.67, 55.92, 40.54, 41.94, 96.52),
}
_FEDALA_T7_MNIST = {
    "fedavg": 98.81,
    "fedprox": 98.82,
    "fedavgc": 99.65,
    "fedproxc": 99.64,
    "perfedavg": 98.90,
    "fedrep": 99.48,
    "pfedme": 99.52,
    "ditto": 99.64,
    "fedamp": 99.47,
    "fedphp": 99.58,
    "fedfomo": 99.33,
    "apple": 99.66,
    "partialfed": 99.67,
    "fedala": 99.71,
}

#: PFLlib's leaderboard, FMNIST Dir(0.1): 20 clients, every client every round, 75/25 train/test split,
#: its 4-layer CNN, batch 10, one local epoch, 2,000 rounds, best accuracy, mean of three trials. Table
#: 7's protocol on another dataset: comparable by rank, not by number.
_PFLLIB_FMNIST_DIR01 = {
    "fedavg": 85.85,
    "fedprox": 85.63,
    "perfedavg": 95.10,
    "pfedme": 97.25,
    "ditto": 97.47,
    "apfl": 97.25,
    "fedfomo": 97.21,
    "fedamp": 97.20,
    "apple": 97.06,
    "fedala": 97.66,
    "fedper": 97.44,
    "fedrep": 97.56,
    "fedrod": 97.52,
    "fedbabu": 97.46,
    "fedcp": 97.89,
    "gpfl": 97.81,
    "feddbe": 97.69,
    "fedproto": 97.40,
}

_FEDALA_T7_CIFAR100_HALF = {
    "fedavg": 39.51,
    "fedprox": 33.87,
    "fedavgc": 47.94,
    "fedproxc": 48.11,
    "perfedavg": 47.96,
    "fedrep": 41.48,
    "pfedme": 43.27,
    "ditto": 48.94,
    "fedphp": 49.99,
    "fedfomo": 37.70,
    "partialfed": 36.49,
    "fedala": 54.81,
}

# FedALA Table 3 (TINY*): minutes per iteration and parameters transmitted per client and iteration
_FEDALA_T3 = {
    "fedavg": (1.59, "2Σ"),
    "fedprox": (1.99, "2Σ"),
    "fedavgc": (24.28, "2Σ"),
    "fedproxc": (28.44, "2Σ"),
    "perfedavg": (3.56, "2Σ"),
    "fedrep": (4.09, "2α_fΣ"),
    "pfedme": (10.24, "2Σ"),
    "ditto": (11.78, "2Σ"),
    "fedamp": (1.53, "2Σ"),
    "fedphp": (4.06, "2Σ"),
    "fedfomo": (2.72, "(1+M)Σ"),
    "apple": (2.93, "(1+M)Σ"),
    "partialfed": (2.13, "2Σ"),
    "fedala": (1.93, "2Σ"),
}

# FedALA Table 4: heterogeneity and scalability columns (a method absent from a column is absent there)
_FEDALA_T4_COLUMNS = ("tiny-dir0.01", "tiny-dir0.5", "agnews-dir1", "cifar100-50clients", "cifar100-100clients")
_FEDALA_T4 = {
    "fedavg": (15.70, 21.14, 87.12, 31.90, 31.95),
    "fedprox": (15.66, 21.22, 87.21, 31.94, 31.97),
    "fedavgc": (49.88, 16.21, 91.38, 49.82, 47.90),
    "fedproxc": (49.84, 16.36, 92.03, 49.79, 48.02),
    "perfedavg": (39.39, 16.36, 87.08, 44.31, 36.07),
    "fedrep": (55.43, 16.74, 92.25, 47.41, 44.61),
    "pfedme": (41.45, 17.48, 87.08, 48.36, 46.45),
    "ditto": (50.62, 18.98, 91.89, 54.22, 52.89),
    "fedamp": (48.42, 12.48, 83.35, 44.39, 40.43),
    "fedphp": (48.63, 21.09, 90.52, 52.44, 49.70),
    "fedfomo": (46.36, 11.59, 91.20, 42.56, 38.91),
    "apple": (48.04, 24.28, 84.10, 55.06, 52.81),
    "partialfed": (49.38, 24.20, 91.01, 48.95, 39.31),
    "fedala": (55.75, 27.85, 92.45, 55.61, 54.68),
}
# FedALA Table 4, applicability of ALA: X + ALA accuracy on TINY and Cifar100 (Dir(0.1)); the paper's
# "Imps." column is this minus X's Table 2 accuracy, which stands beside it as X's row.
_FEDALA_T4_ALA = {
    "fedavg": (40.54, 55.92),
    "fedprox": (40.53, 56.18),
    "perfedavg": (30.90, 48.68),
    "fedrep": (37.89, 53.02),
    "pfedme": (27.30, 47.91),
    "ditto": (40.75, 56.33),
    "fedamp": (28.18, 48.03),
    "fedphp": (40.16, 54.28),
    "partialfed": (35.40, 48.99),
}
# FedALA's sweeps of ALA's settings (FedALA only): Table 1 on TINY* (ResNet-18), Table 6 on TINY
# (4-layer CNN, s = 80 %) and AG News (fastText, s = 80 %); the value swept -> best accuracy %.
_FEDALA_SWEEPS = {
    "fedala-table1/tiny-resnet18-s": (
        "FedALA (AAAI 2023) Table 1 (left), TINY*, p = 1",
        "fedala.sample_fraction",
        {0.05: 39.53, 0.1: 40.62, 0.2: 40.02, 0.4: 40.23, 0.6: 41.11, 0.8: 41.94, 1.0: 42.11},
    ),
    "fedala-table1/tiny-resnet18-p": (
        "FedALA (AAAI 2023) Table 1 (right), TINY*, s = 80 %",
        "fedala.p",
        {6: 41.71, 5: 41.54, 4: 41.62, 3: 41.86, 2: 42.47, 1: 41.94},
    ),
    "fedala-table6/tiny-cnn-p": (
        "FedALA (AAAI 2023) Table 6 (left), TINY, 4-layer CNN, s = 80 %",
        "fedala.p",
        {4: 39.75, 3: 39.89, 2: 39.94, 1: 40.54},
    ),
    "fedala-table6/agnews-fasttext-p": (
        "FedALA (AAAI 2023) Table 6 (right), AG News, fastText, s = 80 %",
        "fedala.p",
        {3: 96.45, 2: 96.40, 1: 96.52},
    ),
}
# Their "Param." rows: ALA's learnable weights per p (Table 1 prints millions: 11.182 ... 0.005)
_FEDALA_SWEEP_PARAMS = {
    "fedala-table1/tiny-resnet18-p": {
        6: 11_182_000,
        5: 11_172_000,
        4: 11_024_000,
        3: 10_499_000,
        2: 8_399_000,
        1: 5_000,
    },
    "fedala-table6/tiny-cnn-p": {4: 582026, 3: 581194, 2: 529930, 1: 5130},
    "fedala-table6/agnews-fasttext-p": {3: 3157508, 2: 1188, 1: 132},
}

_SOSICFL_COLUMNS = {
    "sosicfl-table2": (
        "cifar10-simplecnn-2fold",
        "cifar10-simplecnn-5fold",
        "cifar10-simplecnn-dir0.5",
        "tiny-mobilenetv2-2fold",
        "tiny-mobilenetv2-5fold",
        "tiny-mobilenetv2-dir0.3",
    ),
    "sosicfl-table3": (
        "cifar10-squeezenet-2fold",
        "cifar10-squeezenet-5fold",
        "cifar10-squeezenet-dir0.1",
        "tiny-resnet18-2fold",
        "tiny-resnet18-5fold",
        "tiny-resnet18-dir0.3",
    ),
}
_NA = None
_SOSICFL = {  # (global, local) per column; None: not run in the paper
    "sosicfl-table2": {
        "fedavg": ((68.97, 68.90), (66.76, 66.82), (68.75, 69.13), (10.10, 28.17), (9.51, 27.45), (19.02, 19.29)),
        "fedprox": ((68.73, 68.84), (66.67, 66.70), (68.68, 69.14), (9.77, 28.06), (9.61, 27.49), (19.04, 19.39)),
        "sosicfl": ((70.35, 75.74), (67.54, 71.37), (69.39, 71.24), (11.02, 32.39), (9.89, 31.16), (20.41, 21.31)),
        "ditto": (_NA, (66.50, 79.95), (68.40, 74.87), _NA, (9.74, 30.94), (18.89, 22.69)),
        "sosicfl_plus": (_NA, (67.83, 80.67), (69.83, 75.88), _NA, (10.01, 33.88), (21.18, 24.81)),
    },
    "sosicfl-table3": {
        "fedavg": ((58.69, 58.56), (53.78, 52.51), (48.58, 48.46), (43.46, 54.69), (40.71, 51.68), (49.91, 49.92)),
        "fedprox": ((59.76, 59.28), (29.81, 27.89), (50.08, 50.62), (43.14, 54.66), (40.34, 51.59), (50.04, 49.99)),
        "sosicfl": ((63.32, 71.67), (60.34, 67.86), (54.63, 63.72), (44.05, 60.91), (41.68, 59.56), (50.95, 51.11)),
        "ditto": (_NA, (55.70, 75.56), (50.54, 84.34), _NA, (40.71, 56.16), (49.92, 53.84)),
        "sosicfl_plus": (_NA, (59.78, 78.00), (55.60, 85.42), _NA, (42.14, 61.58), (51.30, 54.42)),
    },
}


_SOSICFL_T5 = {  # (global, local) time-to-accuracy improvements against FedAvg (SosicFL) / Ditto (SosicFL+)
    "sosicfl-table2": {
        "sosicfl": ((1.7, 5.0), (1.2, 3.8), (1.2, 1.9), (1.4, 9.8), (1.1, 7.0), (1.8, 2.4)),
        "sosicfl_plus": (_NA, (1.3, 1.3), (1.6, 1.7), _NA, (1.2, 8.6), (2.9, 7.0)),
    },
    "sosicfl-table3": {
        "sosicfl": ((1.4, 3.3), (1.4, 3.0), (1.6, 2.9), (1.5, 3.1), (1.2, 2.9), (1.4, 3.2)),
        "sosicfl_plus": (_NA, (1.2, 1.4), (1.4, 1.4), _NA, (1.2, 1.9), (2.0, 1.7)),
    },
}


def _tables() -> dict[str, dict[str, Any]]:
    tables: dict[str, dict[str, Any]] = {}
    for i, column in enumerate(_FEDALA_T2_COLUMNS):
        tables[f"fedala-table2/{column}"] = {
            "source": f"FedALA (AAAI 2023) Table 2, {column}",
            "metrics": ("best_accuracy",),
            "values": {m: (v[i],) for m, v in _FEDALA_T2.items()},
        }
    tables["fedala-table7/mnist-dir0.1"] = {
        "source": "FedALA (AAAI 2023) Table 7 (Appendix E), MNIST Dir(0.1), 20 clients",
        "metrics": ("best_accuracy",),
        "values": {m: (v,) for m, v in _FEDALA_T7_MNIST.items()},
    }
    tables["pfllib-benchmark/fmnist-dir0.1"] = {
        "source": "PFLlib's leaderboard (docs/benchmark.html at PFLlib d832e76), FMNIST Dir(0.1), 20 clients, "
        "4-layer CNN, 2,000 rounds, mean of three trials",
        "label": "PFLlib FMNIST",
        "metrics": ("best_accuracy",),
        "values": {m: (v,) for m, v in _PFLLIB_FMNIST_DIR01.items()},
    }
    tables["fedala-table3/tiny-resnet18"] = {
        "source": "FedALA (AAAI 2023) Table 3, TINY* (their GPU; Σ = the model's parameters, M = 20 received models)",
        "metrics": (),
        "values": {},
        "cost": dict(_FEDALA_T3),
    }
    tables["fedala-table7/cifar100-100clients-rho0.5"] = {
        "source": "FedALA (AAAI 2023) Table 7 (Appendix F), Cifar100 Dir(0.1), 100 clients, rho = 0.5, joining "
        "clients only",
        "metrics": ("best_accuracy",),
        "values": {m: (v,) for m, v in _FEDALA_T7_CIFAR100_HALF.items()},
    }
    for i, column in enumerate(_FEDALA_T4_COLUMNS):
        tables[f"fedala-table4/{column}"] = {
            "source": f"FedALA (AAAI 2023) Table 4, {column}",
            "metrics": ("best_accuracy",),
            "values": {m: (v[i],) for m, v in _FEDALA_T4.items()},
        }
    for i, (column, t2_column) in enumerate((("ala-tiny", "tiny-dir0.1"), ("ala-cifar100", "cifar100-dir0.1"))):
        values = {}
        for m, v in _FEDALA_T4_ALA.items():
            values[m] = (_FEDALA_T2[m][_FEDALA_T2_COLUMNS.index(t2_column)],)
            values[f"{m}+ala"] = (v[i],)
        tables[f"fedala-table4/{column}"] = {
            "source": f"FedALA (AAAI 2023) Table 4, applicability of ALA, {column} (X: its Table 2 {t2_column} cell)",
            "metrics": ("best_accuracy",),
            "values": values,
        }
    for name, (source, key, series) in _FEDALA_SWEEPS.items():
        tables[name] = {
            "source": source,
            "metrics": (),
            "values": {},
            "sweep": {
                "key": key,
                "algorithm": "fedala",
                "metric": "best_accuracy",
                "values": series,
                "params": _FEDALA_SWEEP_PARAMS.get(name, {}),
            },
        }
    for table, columns in _SOSICFL_COLUMNS.items():
        for i, column in enumerate(columns):
            pairs = {m: cells[i] for m, cells in _SOSICFL[table].items() if cells[i] is not None}
            tables[f"{table}/{column}"] = {
                "source": f"SosicFL Table {table[-1]}, {column} (global / local)",
                "metrics": ("best_global_accuracy", "best_local_accuracy"),
                "values": pairs,
                "tta": {m: cells[i] for m, cells in _SOSICFL_T5[table].items() if cells[i] is not None},
                "tta_source": f"SosicFL Table 5, {column} (global / local)",
            }
    return tables


#: "<table>/<column>" -> {"source", "metrics" (our summary keys), "values" {method: (paper %, ...)}};
#: a sweep's cell has "sweep" {"key" (the swept config key), "algorithm", "metric", "values" {value: paper %}}
PAPER_TABLES: dict[str, dict[str, Any]] = _tables()


def paper_cell(name: str) -> dict[str, Any]:
    """The published numbers of ``paper_table = name``, with a clear error for unknown names."""
    if name not in PAPER_TABLES:
        raise ValueError(
            f"paper_table = {name!r} is not a table pflkit ships; known: {', '.join(sorted(PAPER_TABLES))}"
        )
    return PAPER_TABLES[name]

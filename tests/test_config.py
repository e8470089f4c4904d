"""Config parsing, overrides and the shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from pflkit.config import ConfigError, load_config, parse_override, read_toml, split_overrides, to_dict
from pflkit.data import FILE_DATASETS

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_overrides_parse_as_toml_values_with_bare_word_fallback():
    assert parse_override("rounds=3") == (["rounds"], 3)
    assert parse_override('algorithms=["fedavg","fedala"]') == (["algorithms"], ["fedavg", "fedala"])
    assert parse_override("fedala.eta=0.5") == (["fedala", "eta"], 0.5)
    assert parse_override("dataset=mnist") == (["dataset"], "mnist")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("rounds")


def test_overrides_apply_on_top_of_a_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('rounds = 7\nalgorithms = ["fedavg"]\n[fedala]\np = 2\n')
    cfg = load_config(path, ["fedala.eta=0.5", "rounds=3"])
    assert cfg.rounds == 3 and cfg.fedala.eta == 0.5 and cfg.fedala.p == 2 and cfg.algorithms == ["fedavg"]


def test_digits_demo_config_is_the_default_experiment():
    shipped, default = load_config(CONFIGS / "digits_demo.toml"), load_config()
    assert shipped.resolved_model == default.resolved_model
    assert {**to_dict(shipped), "model": None} == {**to_dict(default), "model": None}


SHAPES = {"digits": ((1, 8, 8), 10), "mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10),
          "cifar100": ((3, 32, 32), 100), "tiny_imagenet": ((3, 64, 64), 200), "agnews": ((200,), 4)}


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_every_algorithm_fits_their_model(path):
    from pflkit.algorithms import TrainSettings, build_algorithm
    from pflkit.models import build_model
    from pflkit.run.sweep import plan_sweep

    reads_files = read_toml(path).get("dataset", "digits") in FILE_DATASETS
    where = ["data_dir='/somewhere'"] if reads_files else []  # data_dir for a built-in dataset is refused
    if path.name.endswith("-sweep.toml"):  # a sweep file: every cell of its grid
        configs = [cfg for _, cfg in plan_sweep(str(path), where)[2]]
    else:
        configs = [load_config(path, where)]
    for cfg in configs:
        shape, classes = SHAPES[cfg.dataset]
        model = build_model(cfg.model_for(shape), shape, classes, vocab_size=1000)
        for name in cfg.algorithms:  # e.g. fedala.p beyond the model's units would fail here
            build_algorithm(name, cfg.algorithm_sections(), TrainSettings.from_config(cfg), model.units())
        if cfg.partition_seed == 1:  # the paper configs draw PFLlib's split
            assert cfg.partition_rng == "pfllib"


PAPER_COLUMNS = {  # FedALA Table 2 / Table 4: dataset, model, partition, alpha or classes, lr, clients
    "table2-mnist-pathological": ("mnist", "fedavg_cnn", "pathological", 2, 0.1, 20),
    "table2-cifar10-pathological": ("cifar10", "fedavg_cnn", "pathological", 2, 0.005, 20),
    "table2-cifar100-pathological": ("cifar100", "fedavg_cnn", "pathological", 10, 0.005, 20),
    "table2-cifar10-dir0.1": ("cifar10", "fedavg_cnn", "dirichlet", 0.1, 0.005, 20),
    "table2-cifar100-dir0.1": ("cifar100", "fedavg_cnn", "dirichlet", 0.1, 0.005, 20),
    "table2-tiny-dir0.1": ("tiny_imagenet", "fedavg_cnn", "dirichlet", 0.1, 0.005, 20),
    "table2-tiny-resnet18-dir0.1": ("tiny_imagenet", "resnet18", "dirichlet", 0.1, 0.1, 20),
    "table2-agnews-dir0.1": ("agnews", "fasttext", "dirichlet", 0.1, 0.1, 20),
    "table4-tiny-dir0.01": ("tiny_imagenet", "fedavg_cnn", "dirichlet", 0.01, 0.005, 20),
    "table4-tiny-dir0.5": ("tiny_imagenet", "fedavg_cnn", "dirichlet", 0.5, 0.005, 20),
    "table4-agnews-dir1": ("agnews", "fasttext", "dirichlet", 1.0, 0.1, 20),
    "table4-cifar100-50clients": ("cifar100", "fedavg_cnn", "dirichlet", 0.1, 0.005, 50),
    "table4-cifar100-100clients": ("cifar100", "fedavg_cnn", "dirichlet", 0.1, 0.005, 100),
}


@pytest.mark.parametrize("name", sorted(PAPER_COLUMNS))
def test_paper_configs_have_the_papers_settings_and_every_method(name):
    cfg = load_config(CONFIGS / "paper" / f"{name}.toml", ["data_dir='/x'"])
    dataset, model, partition, level, lr, clients = PAPER_COLUMNS[name]
    assert (cfg.dataset, cfg.model, cfg.partition, cfg.lr, cfg.num_clients) == (dataset, model, partition, lr, clients)
    assert (cfg.classes_per_client if partition == "pathological" else cfg.alpha) == level
    assert (cfg.batch_size, cfg.local_epochs, cfg.join_ratio, cfg.rounds, len(cfg.seeds)) == (10, 1, 1.0, 2000, 5)
    assert len(cfg.algorithms) == 14 and "fedala" in cfg.algorithms


def test_paper_ala_applicability_configs_pair_each_method_with_its_ala_variant():
    for name in ("table4-ala-tiny", "table4-ala-cifar100"):
        algorithms = load_config(CONFIGS / "paper" / f"{name}.toml", ["data_dir='/x'"]).algorithms
        bases = ["fedavg", "fedprox", "perfedavg", "fedrep", "pfedme", "ditto", "fedamp", "fedphp", "partialfed"]
        assert algorithms == [a for b in bases for a in (b, f"{b}+ala")]


def test_mnist_paper_config_has_the_papers_settings():
    cfg = load_config(CONFIGS / "mnist_fedala.toml", ["data_dir='/x'"])
    assert (cfg.num_clients, cfg.partition, cfg.alpha, cfg.lr, cfg.batch_size, cfg.local_epochs) == \
        (20, "dirichlet", 0.1, 0.1, 10, 1)
    assert (cfg.fedala.eta, cfg.fedala.sample_fraction, cfg.fedala.p) == (1.0, 0.8, 1)
    assert cfg.resolved_model == "fedavg_cnn"


def test_override_strings_split_outside_quotes_and_brackets():
    text = "rounds=2 algorithms=['fedala', 'fedavg'] name=\"a b\" fedala.eta=0.5"
    assert split_overrides(text) == ["rounds=2", "algorithms=['fedala', 'fedavg']", 'name="a b"', "fedala.eta=0.5"]
    cfg = load_config(None, split_overrides(text))
    assert cfg.algorithms == ["fedala", "fedavg"] and cfg.name == "a b" and cfg.rounds == 2
    with pytest.raises(ConfigError, match="unbalanced"):
        split_overrides("algorithms=['fedala'")


FEDACD_METHODS = {"fedavg", "fedprox", "fednova", "fedrod", "creff", "fedntd", "fedlc", "feddecorr", "fednh", "fedacd"}


@pytest.mark.parametrize("path", sorted((CONFIGS / "paper").glob("fedacd-*.toml")), ids=lambda p: p.stem)
def test_fedacd_configs_have_the_papers_setting_and_name_their_table(path):
    cfg = load_config(path, ["data_dir='/x'"])
    assert (cfg.test_set, cfg.batch_size, cfg.lr, cfg.momentum, cfg.rounds, cfg.balance_cap) == \
        ("official", 64, 0.01, 0.9, 200, False)
    assert cfg.min_samples_per_client == 0 and len(cfg.seeds) == 5 and set(cfg.algorithms) <= FEDACD_METHODS
    assert cfg.model == ("resnet18_gn" if cfg.dataset == "tiny_imagenet" else "conv2cifar")  # FedNH's lineage
    assert cfg.fednh.scale == (20.0 if cfg.dataset == "tiny_imagenet" else 1.0)  # FedNH's ResNetModNH / its CNN
    assert "feddecorr" not in cfg.algorithms or cfg.feddecorr.beta == (0.05 if cfg.dataset == "cifar100" else 0.1)
    # [RECON]: FedNH's and FedNTD's code on the same settings; weight decay as theirs (Tiny: the spec's 1e-3 too)
    assert (cfg.lr_decay, cfg.weight_decay) == (0.99, 1e-3 if cfg.dataset == "tiny_imagenet" else 1e-5)
    header = path.read_text().split("\n", 1)[0]
    assert header.startswith("# FedACD Table") and "[UNCERTAIN]" in path.read_text()
    if "tables1-3" in path.name:
        assert set(cfg.algorithms) == FEDACD_METHODS and cfg.metrics.adaptability


# spec §4.12 (paper Appendix A): model -> (rounds, join ratio, batch, epochs, lr, momentum, FedProx mu)
SOSICFL_SETTINGS = {"simple_cnn": (500, 0.3, 50, 5, 0.02, 0.5, 0.01),
                    "squeezenet1_1": (500, 0.1, 32, 1, 0.001, 0.9, 0.1),
                    "mobilenet_v2": (500, 0.1, 64, 5, 0.01, 0.9, 0.1),
                    "resnet18": (200, 0.1, 32, 5, 0.01, 0.9, 0.001)}


@pytest.mark.parametrize("path", sorted((CONFIGS / "paper").glob("sosicfl-*.toml")), ids=lambda p: p.stem)
def test_sosicfl_configs_have_the_papers_setting_and_name_their_table(path):
    cfg = load_config(path, ["data_dir='/x'"])
    mu = cfg.fedprox.mu if "fedprox" in cfg.algorithms else SOSICFL_SETTINGS[cfg.model][-1]  # no FedProx, no [fedprox]
    assert (cfg.rounds, cfg.join_ratio, cfg.batch_size, cfg.local_epochs, cfg.lr, cfg.momentum, mu) == \
        SOSICFL_SETTINGS[cfg.model]
    assert (cfg.test_set, cfg.num_clients, cfg.eval_every, cfg.eval_all_clients, len(cfg.seeds)) == \
        ("official", 100, 10, True, 5)
    assert cfg.partition in ("kfold", "label_dirichlet")
    if "fig7" not in path.name:
        expected = {(2, "kfold"): (2, 0.6), (5, "kfold"): (5, 0.4)}.get((cfg.num_folds, cfg.partition), (10, 0.4))
        assert (cfg.sosicfl.num_clusters, cfg.sosicfl.rho) == expected
    if "2fold" in path.name:
        assert "ditto" not in cfg.algorithms and "sosicfl_plus" not in cfg.algorithms  # not run on 2-Fold
    if "fig7" in path.name or "fig8" in path.name:
        assert cfg.algorithms == ["fedavg", "sosicfl"]  # the baseline the figures compare with
    assert path.read_text().startswith("# SosicFL Table") or path.read_text().startswith("# SosicFL Figure")
    assert "[UNCERTAIN]" in path.read_text()


def test_keys_the_chosen_setting_never_reads_are_named_in_a_warning(caplog):
    with caplog.at_level("WARNING", logger="pflkit.config"):
        load_config(None, ["partition=iid", "classes_per_client=3", "fedala.p=3", 'algorithms=["fedavg"]',
                           "num_folds=3", 'test_set="client_split"', "train_fraction=0.5"])
    text = caplog.text
    assert "classes_per_client = 3 is not used: only partition = pathological reads it" in text
    assert "num_folds = 3 is not used: only partition = kfold reads it" in text
    assert "[fedala] is not used: no method of algorithms = ['fedavg'] reads it" in text
    assert "train_fraction" not in text  # client_split reads it
    caplog.clear()
    with caplog.at_level("WARNING", logger="pflkit.config"):
        load_config(None, ["partition=pathological", "classes_per_client=3", "fedala.p=2", "sosicfl.num_endpoints=4",
                           'algorithms=["fedprox+ala", "sosicfl_all"]'])
    assert "not used" not in caplog.text  # +ala reads [fedala]; sosicfl_all reads [sosicfl]
    caplog.clear()
    with caplog.at_level("WARNING", logger="pflkit.config"):  # a file's sections for methods not run now
        load_config(CONFIGS / "mnist_fedala.toml", ["data_dir='/x'", 'algorithms=["fedavg"]'])
    assert "not used" not in caplog.text
    # read in less obvious places: PFLlib's iid is its pathological rule; the official split still sizes
    # PFLlib's default minimum of a Dirichlet partition with train_fraction
    for read in (["partition=iid", 'partition_rng="pfllib"', "balanced=true"],
                 ['test_set="official"', "partition=dirichlet", "train_fraction=0.9"]):
        caplog.clear()
        with caplog.at_level("WARNING", logger="pflkit.config"):
            load_config(None, read)
        assert "not used" not in caplog.text, read
    caplog.clear()
    with caplog.at_level("WARNING", logger="pflkit.config"):
        load_config(None, ['test_set="official"', "partition=label_dirichlet", "train_fraction=0.9", "balanced=true"])
    assert "train_fraction = 0.9 is not used" in caplog.text and "balanced = True is not used" in caplog.text


def test_no_shipped_config_sets_a_key_it_does_not_use(caplog):
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "configs"
    for path in sorted(root.rglob("*.toml")):
        if "[sweep]" in path.read_text():
            continue
        caplog.clear()
        with caplog.at_level("WARNING", logger="pflkit.config"):
            try:
                load_config(path)
            except ConfigError as exc:  # file datasets need a folder
                assert "needs data_dir" in str(exc)
                load_config(path, ["data_dir='/x'"])
        assert "not used" not in caplog.text, (path, caplog.text)

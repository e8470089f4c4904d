"""Config parsing, overrides and the shipped configs."""

from __future__ import annotations

import re

import pytest
import tomli_w

from pflkit.config import ConfigError, load_config, parse_override, read_toml, split_overrides, to_dict
from pflkit.data import FILE_DATASETS
from tests.support.configs import flat_form
from tests.support.paths import REPO

CONFIGS = REPO / "configs"


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
    assert cfg.train.rounds == 3 and cfg.fedala.eta == 0.5 and cfg.fedala.p == 2 and cfg.algorithms == ["fedavg"]


def test_digits_demo_config_is_the_default_experiment():
    shipped, default = load_config(CONFIGS / "digits_demo.toml"), load_config()
    assert shipped.resolved_model == default.resolved_model
    assert {**to_dict(shipped), "model": None} == {**to_dict(default), "model": None}


SHAPES = {
    "digits": ((1, 8, 8), 10),
    "mnist": ((1, 28, 28), 10),
    "digit5": ((3, 28, 28), 10),
    "cifar10": ((3, 32, 32), 10),
    "cifar100": ((3, 32, 32), 100),
    "tiny_imagenet": ((3, 64, 64), 200),
    "agnews": ((200,), 4),
}


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_every_algorithm_fits_their_model(path):
    from pflkit.methods import build_algorithm
    from pflkit.models import build_model
    from pflkit.run.sweep import plan_sweep

    reads_files = read_toml(path).get("dataset", "digits") in FILE_DATASETS
    where = ["data_dir='/somewhere'"] if reads_files else []  # data_dir for a built-in dataset is refused
    if "sweep" in read_toml(path):  # a sweep file: every cell of its grid
        configs = [cfg for _, cfg in plan_sweep(str(path), where)[2]]
    else:
        configs = [load_config(path, where)]
    for cfg in configs:
        shape, classes = SHAPES[cfg.dataset]
        model = build_model(cfg.model_for(shape), shape, classes, vocab_size=1000)
        for name in cfg.algorithms:  # e.g. fedala.p beyond the model's units would fail here
            build_algorithm(name, cfg.algorithm_sections(), cfg.train, model.units())
        if cfg.partition.seed == 1:  # the paper configs draw PFLlib's split
            assert cfg.partition.rng == "pfllib"


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
    p, t = cfg.partition, cfg.train
    assert (cfg.dataset, cfg.model, p.method, t.lr, p.num_clients) == (dataset, model, partition, lr, clients)
    assert (p.classes_per_client if partition == "pathological" else p.alpha) == level
    assert (t.batch_size, t.local_epochs, cfg.run.join_ratio, t.rounds, len(cfg.seeds)) == (10, 1, 1.0, 2000, 5)
    assert len(cfg.algorithms) == 14 and "fedala" in cfg.algorithms


def test_paper_ala_applicability_configs_pair_each_method_with_its_ala_variant():
    for name in ("table4-ala-tiny", "table4-ala-cifar100"):
        algorithms = load_config(CONFIGS / "paper" / f"{name}.toml", ["data_dir='/x'"]).algorithms
        bases = ["fedavg", "fedprox", "perfedavg", "fedrep", "pfedme", "ditto", "fedamp", "fedphp", "partialfed"]
        assert algorithms == [a for b in bases for a in (b, f"{b}+ala")]


def test_mnist_paper_config_has_the_papers_settings():
    cfg = load_config(CONFIGS / "mnist_fedala.toml", ["data_dir='/x'"])
    p, t = cfg.partition, cfg.train
    assert (p.num_clients, p.method, p.alpha, t.lr, t.batch_size, t.local_epochs) == (20, "dirichlet", 0.1, 0.1, 10, 1)
    assert (cfg.fedala.eta, cfg.fedala.sample_fraction, cfg.fedala.p) == (1.0, 0.8, 1)
    assert cfg.resolved_model == "fedavg_cnn"


def test_override_strings_split_outside_quotes_and_brackets():
    text = "rounds=2 algorithms=['fedala', 'fedavg'] name=\"a b\" fedala.eta=0.5"
    assert split_overrides(text) == ["rounds=2", "algorithms=['fedala', 'fedavg']", 'name="a b"', "fedala.eta=0.5"]
    cfg = load_config(None, split_overrides(text))
    assert cfg.algorithms == ["fedala", "fedavg"] and cfg.name == "a b" and cfg.train.rounds == 2
    with pytest.raises(ConfigError, match="unbalanced"):
        split_overrides("algorithms=['fedala'")


FEDACD_METHODS = {"fedavg", "fedprox", "fednova", "fedrod", "creff", "fedntd", "fedlc", "feddecorr", "fednh", "fedacd"}


@pytest.mark.parametrize("path", sorted((CONFIGS / "paper").glob("fedacd-*.toml")), ids=lambda p: p.stem)
def test_fedacd_configs_have_the_papers_setting_and_name_their_table(path):
    cfg = load_config(path, ["data_dir='/x'"])
    p, t = cfg.partition, cfg.train
    assert (p.test_set, t.batch_size, t.lr, t.momentum, t.rounds, p.balance_cap) == (
        "official",
        64,
        0.01,
        0.9,
        200,
        False,
    )
    assert cfg.partition.min_samples_per_client == 0 and len(cfg.seeds) == 5 and set(cfg.algorithms) <= FEDACD_METHODS
    assert cfg.model == ("resnet18_gn" if cfg.dataset == "tiny_imagenet" else "conv2cifar")  # FedNH's lineage
    assert cfg.fednh.scale == (20.0 if cfg.dataset == "tiny_imagenet" else 1.0)  # FedNH's ResNetModNH / its CNN
    assert "feddecorr" not in cfg.algorithms or cfg.feddecorr.beta == (0.05 if cfg.dataset == "cifar100" else 0.1)
    # reconstructed (docs/explanations/reconstructions.md): FedNH's and FedNTD's code on the same settings;
    # lr decay and weight decay as theirs (Tiny ImageNet: weight decay 1e-3)
    assert (cfg.train.lr_decay, cfg.train.weight_decay) == (0.99, 1e-3 if cfg.dataset == "tiny_imagenet" else 1e-5)
    header = path.read_text().split("\n", 1)[0]
    assert header.startswith("# FedACD Table") and "[UNCERTAIN]" in path.read_text()
    if "tables1-3" in path.name:
        assert set(cfg.algorithms) == FEDACD_METHODS and cfg.metrics.adaptability


# SosicFL paper, Appendix A (Table 4): model -> (rounds, join ratio, batch, epochs, lr, momentum, FedProx mu)
SOSICFL_SETTINGS = {
    "simple_cnn": (500, 0.3, 50, 5, 0.02, 0.5, 0.01),
    "squeezenet1_1": (500, 0.1, 32, 1, 0.001, 0.9, 0.1),
    "mobilenet_v2": (500, 0.1, 64, 5, 0.01, 0.9, 0.1),
    "resnet18": (200, 0.1, 32, 5, 0.01, 0.9, 0.001),
}


@pytest.mark.parametrize("path", sorted((CONFIGS / "paper").glob("sosicfl-*.toml")), ids=lambda p: p.stem)
def test_sosicfl_configs_have_the_papers_setting_and_name_their_table(path):
    cfg = load_config(path, ["data_dir='/x'"])
    mu = cfg.fedprox.mu if "fedprox" in cfg.algorithms else SOSICFL_SETTINGS[cfg.model][-1]  # no FedProx, no [fedprox]
    p, t, r = cfg.partition, cfg.train, cfg.run
    assert (t.rounds, r.join_ratio, t.batch_size, t.local_epochs, t.lr, t.momentum, mu) == SOSICFL_SETTINGS[cfg.model]
    assert (p.test_set, p.num_clients, r.eval_every, r.eval_all_clients, len(cfg.seeds)) == (
        "official",
        100,
        10,
        True,
        5,
    )
    assert p.method in ("kfold", "label_dirichlet")
    if "fig7" not in path.name:
        expected = {(2, "kfold"): (2, 0.6), (5, "kfold"): (5, 0.4)}.get((p.num_folds, p.method), (10, 0.4))
        assert (cfg.sosicfl.num_clusters, cfg.sosicfl.rho) == expected
    if "2fold" in path.name:
        assert "ditto" not in cfg.algorithms and "sosicfl_plus" not in cfg.algorithms  # not run on 2-Fold
    if "fig7" in path.name or "fig8" in path.name:
        assert cfg.algorithms == ["fedavg", "sosicfl"]  # the baseline the figures compare with
    assert path.read_text().startswith("# SosicFL Table") or path.read_text().startswith("# SosicFL Figure")
    assert "[UNCERTAIN]" in path.read_text()


def test_keys_the_chosen_setting_never_reads_are_named_in_a_warning(caplog):
    with caplog.at_level("WARNING", logger="pflkit.config"):
        load_config(
            None,
            [
                "partition=iid",
                "classes_per_client=3",
                "fedala.p=3",
                'algorithms=["fedavg"]',
                "num_folds=3",
                'test_set="client_split"',
                "train_fraction=0.5",
            ],
        )
    text = caplog.text
    assert "classes_per_client = 3 is not used: only partition = pathological or exdir reads it" in text
    assert "num_folds = 3 is not used: only partition = kfold reads it" in text
    assert "[fedala] is not used: no method of algorithms = ['fedavg'] reads it" in text
    assert "train_fraction" not in text  # client_split reads it
    caplog.clear()
    with caplog.at_level("WARNING", logger="pflkit.config"):
        load_config(
            None,
            [
                "partition=pathological",
                "classes_per_client=3",
                "fedala.p=2",
                "sosicfl.num_endpoints=4",
                'algorithms=["fedprox+ala", "sosicfl_all"]',
            ],
        )
    assert "not used" not in caplog.text  # +ala reads [fedala]; sosicfl_all reads [sosicfl]
    caplog.clear()
    with caplog.at_level("WARNING", logger="pflkit.config"):  # a file's sections for methods not run now
        load_config(CONFIGS / "mnist_fedala.toml", ["data_dir='/x'", 'algorithms=["fedavg"]'])
    assert "not used" not in caplog.text
    # read in less obvious places: PFLlib's iid is its pathological rule; the official split still sizes
    # PFLlib's default minimum of a Dirichlet partition with train_fraction
    for read in (
        ["partition=iid", 'partition_rng="pfllib"', "balanced=true"],
        ['test_set="official"', "partition=dirichlet", "train_fraction=0.9"],
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="pflkit.config"):
            load_config(None, read)
        assert "not used" not in caplog.text, read
    caplog.clear()
    with caplog.at_level("WARNING", logger="pflkit.config"):
        load_config(None, ['test_set="official"', "partition=label_dirichlet", "train_fraction=0.9", "balanced=true"])
    assert "train_fraction = 0.9 is not used" in caplog.text and "balanced = True is not used" in caplog.text


def test_a_saved_resolved_config_reads_back_without_warnings(tmp_path, caplog):
    """A results folder's config.toml writes every default, also of partition keys its partition
    does not read; rerunning it (pflkit run <cell>/config.toml) must not warn about them, while a
    value the user set away from its default still does."""
    saved = tmp_path / "config.toml"
    saved.write_text(tomli_w.dumps(to_dict(load_config(None, ["partition=dirichlet", "num_clients=5"]))))
    with caplog.at_level("WARNING", logger="pflkit.config"):
        load_config(saved)
    assert "not used" not in caplog.text
    with caplog.at_level("WARNING", logger="pflkit.config"):
        load_config(saved, ["partition.classes_per_client=3"])
    assert "classes_per_client = 3 is not used" in caplog.text


def test_no_shipped_config_sets_a_key_it_does_not_use(caplog):
    root = REPO / "configs"
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


# ---- sections and their flat aliases ------------------------------------------------------------
FLAT = {
    "lr": 0.05,
    "rounds": 5,
    "partition": "pathological",
    "partition_rng": "pfllib",
    "partition_seed": 1,
    "num_clients": 10,
    "classes_per_client": 2,
    "join_ratio": 0.5,
    "engine": "loop",
}
NESTED = {
    "partition": {"method": "pathological", "rng": "pfllib", "seed": 1, "num_clients": 10, "classes_per_client": 2},
    "train": {"lr": 0.05, "rounds": 5},
    "run": {"join_ratio": 0.5, "engine": "loop"},
}


def test_every_flat_key_names_a_field_of_its_section():
    from pflkit.config import FLAT_KEYS, ExperimentConfig

    for key, (section, field) in FLAT_KEYS.items():
        assert field in ExperimentConfig.model_fields[section].annotation.model_fields, key
        assert key == section or key not in ExperimentConfig.model_fields, key  # only partition is both


def test_flat_and_sectioned_spellings_give_equal_configs(tmp_path):
    from pflkit.config import build_config

    flat, nested = build_config(FLAT), build_config(NESTED)
    assert flat == nested and to_dict(flat) == to_dict(nested)
    assert (nested.train.lr, nested.partition.method, nested.partition.rng, nested.partition.seed) == (
        0.05,
        "pathological",
        "pfllib",
        1,
    )
    assert (nested.partition.num_clients, nested.run.join_ratio, nested.run.engine, nested.train.rounds) == (
        10,
        0.5,
        "loop",
        5,
    )
    mixed = {"lr": 0.05, "rounds": 5, "partition": NESTED["partition"], "run": NESTED["run"]}
    assert build_config(mixed) == nested
    for name, table in (("flat", FLAT), ("nested", NESTED)):  # and as files
        (tmp_path / f"{name}.toml").write_text(tomli_w.dumps(table))
    assert load_config(tmp_path / "flat.toml") == load_config(tmp_path / "nested.toml") == nested


def test_overrides_of_either_spelling_set_the_same_setting(tmp_path):
    assert load_config(None, ["lr=0.05"]) == load_config(None, ["train.lr=0.05"])
    assert load_config(None, ["partition=iid"]) == load_config(None, ["partition.method=iid"])
    assert load_config(None, ["partition_seed=3"]).partition.seed == 3
    flat, nested = tmp_path / "flat.toml", tmp_path / "nested.toml"
    flat.write_text("lr = 0.1\nrounds = 7\n")
    nested.write_text("[train]\nlr = 0.1\nrounds = 7\n")
    for path in (flat, nested):  # an override replaces the file's value whichever spelling either uses
        for item in ("lr=0.05", "train.lr=0.05"):
            cfg = load_config(path, [item])
            assert (cfg.train.lr, cfg.train.rounds) == (0.05, 7), (path.name, item)
    assert load_config(None, ["lr=0.05", "train.lr=0.02"]).train.lr == 0.02  # the last override wins


def test_a_setting_given_both_ways_is_refused_naming_both(tmp_path):
    from pflkit.config import build_config

    with pytest.raises(ConfigError, match=r"lr and train\.lr are the same setting"):
        build_config({"lr": 0.1, "train": {"lr": 0.2}})
    path = tmp_path / "both.toml"
    path.write_text("num_clients = 10\n[partition]\nnum_clients = 12\n")
    with pytest.raises(ConfigError, match=r"both\.toml\):\n  num_clients and partition\.num_clients are the same"):
        load_config(path)


@pytest.mark.parametrize(
    "overrides, file, line",
    [
        (["lr=-1"], "", "  lr: must be > 0.0 (got -1)"),
        (["train.lr=-1"], "", "  train.lr: must be > 0.0 (got -1)"),
        ([], "lr = -1\n", "  lr: must be > 0.0 (got -1)"),
        ([], "[train]\nlr = -1\n", "  train.lr: must be > 0.0 (got -1)"),
        (["train.lr=-1"], "lr = 0.1\n", "  train.lr: must be > 0.0 (got -1)"),  # the override's spelling
        (["lr=-1"], "[train]\nlr = 0.1\n", "  lr: must be > 0.0 (got -1)"),
        (["partition=random"], "", "  partition: must be one of 'iid', 'dirichlet'"),
        (["partition.method=random"], "", "  partition.method: must be one of 'iid', 'dirichlet'"),
        (["partition_rng=numpy"], "", "  partition_rng: must be one of 'pflkit' or 'pfllib' (got 'numpy')"),
        (["join_ratio=1.5"], "", "  join_ratio: must be <= 1.0 (got 1.5)"),
        ([], "[run]\njoin_ratio = 1.5\n", "  run.join_ratio: must be <= 1.0 (got 1.5)"),
        (["device=tpu"], "", "  device: device must be cpu, cuda, cuda:N or auto"),
        (["num_client=3"], "", "  num_client: unknown key (did you mean 'num_clients'?)"),
        (["partition.num_client=3"], "", "  partition.num_client: unknown key (did you mean 'num_clients'?)"),
        (["lrr=0.1"], "", "  lrr: unknown key (did you mean 'lr'?)"),
        (["train.lrr=0.1"], "", "  train.lrr: unknown key (did you mean 'lr'?)"),
        (['algorithms=["fedamp"]', "join_ratio=0.5"], "", "join_ratio must be 1, got 0.5"),
        (['algorithms=["fedamp"]', "run.join_ratio=0.5"], "", "run.join_ratio must be 1, got 0.5"),
        (["metrics.adaptability=true"], "", 'it needs test_set = "official"'),  # not written: its flat key
        (
            ["metrics.adaptability=true", "partition.test_set='client_split'"],
            "",
            'it needs partition.test_set = "official"',
        ),
    ],
)
def test_errors_name_the_key_as_written(tmp_path, overrides, file, line):
    path = None
    if file:
        path = tmp_path / "c.toml"
        path.write_text(file)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert line in str(info.value), str(info.value)


def test_unused_partition_keys_are_named_as_written(caplog):
    with caplog.at_level("WARNING", logger="pflkit.config"):
        load_config(None, ["partition=iid", "classes_per_client=3", "partition.num_folds=3"])
    assert "classes_per_client = 3 is not used: only partition = pathological or exdir reads it" in caplog.text
    assert "partition.num_folds = 3 is not used: only partition = kfold reads it" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pflkit.config"):
        load_config(None, ["partition.method=kfold", "partition.num_folds=3", "num_clients=10"])
    assert "not used" not in caplog.text


def test_a_sweep_grid_over_a_flat_key_sweeps_its_setting():
    from pflkit.run.sweep import plan_sweep

    fixed, axes, cells = plan_sweep(None, ["rounds=1", "lr=[0.1,0.2]", "partition=['iid','dirichlet']"])
    assert fixed == ["rounds=1"] and [a.key for a in axes] == ["lr", "partition"]
    assert [(c.train.lr, c.partition.method) for _, c in cells] == [
        (0.1, "iid"),
        (0.1, "dirichlet"),
        (0.2, "iid"),
        (0.2, "dirichlet"),
    ]
    assert {c.train.rounds for _, c in cells} == {1}
    assert [c.train.lr for _, c in plan_sweep(None, ["train.lr=[0.1,0.2]"])[2]] == [0.1, 0.2]
    with pytest.raises(ConfigError, match=r"sweep over train\.lr is given twice \(as lr and train\.lr\)"):
        plan_sweep(None, ["lr=[0.1]", "train.lr=[0.2]"])


def test_to_dict_writes_the_sectioned_form_and_reloads_to_the_same_config(tmp_path):
    from pflkit.config import FLAT_KEYS, build_config

    cfg = load_config(
        None,
        [
            "lr=0.05",
            "partition=pathological",
            "partition_seed=2",
            "join_ratio=0.5",
            'algorithms=["fedavg","fedala"]',
            "fedala.p=2",
        ],
    )
    table = to_dict(cfg)
    assert not set(table) & (set(FLAT_KEYS) - {"partition"})
    assert table["train"]["lr"] == 0.05 and table["partition"]["method"] == "pathological"
    assert table["partition"]["seed"] == 2 and table["run"]["join_ratio"] == 0.5 and table["fedala"]["p"] == 2
    assert build_config(table) == cfg
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(table))
    assert load_config(path) == cfg and to_dict(load_config(path)) == table
    assert build_config(flat_form(table)) == cfg  # the flat form an older pflkit wrote


def test_a_sweep_cell_folder_with_an_older_flat_config_is_the_same_config(tmp_path):
    from pflkit.federation import ResultsFolder
    from pflkit.run.sweep import saved_differences

    cfg = load_config(None, ["lr=0.05", "num_clients=5"])
    path, folder = tmp_path / "config.toml", ResultsFolder(tmp_path)
    path.write_text(tomli_w.dumps(flat_form(to_dict(cfg))))
    assert saved_differences(folder, cfg) == []
    assert saved_differences(folder, load_config(None, ["lr=0.05", "num_clients=6"])) == ["partition.num_clients"]
    path.write_text("lr = -1\n")
    assert saved_differences(folder, cfg)[0].startswith("(its config.toml does not load")
    path.write_text("lr = = 1\n")
    assert saved_differences(folder, cfg)[0].startswith("(its config.toml does not load")


def test_config_keys_lists_every_key_with_its_flat_alias():
    from click.testing import CliRunner

    from pflkit.cli import main

    result = CliRunner().invoke(main, ["config", "--keys"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "train.lr (flat: lr) = 0.1" in lines and 'partition.method (flat: partition) = "dirichlet"' in lines
    assert "partition.seed (flat: partition_seed) = unset" in lines and "fedala.p = 1" in lines
    assert 'run.engine (flat: engine) = "auto"' in lines and "partition.max_retries = 1000" in lines
    printed = CliRunner().invoke(main, ["config", "lr=0.05"]).output
    assert "[train]\n" in printed and "lr = 0.05\n" in printed and "[partition]\n" in printed


def test_the_model_keys_description_names_every_registered_model():
    from pflkit.config.schema import BaseConfig
    from pflkit.models import MODELS

    words = set(re.findall(r"\w+", BaseConfig.model_fields["model"].description or ""))
    assert [name for name in MODELS if name not in words] == []


def test_a_section_override_updates_the_files_section_instead_of_replacing_it(tmp_path):
    """`train={batch_size=5}` sets one key of [train]: the file's flat `lr` (moved into [train]) and
    its `num_clients` stay, and an error in the table names the key in its section."""
    path = tmp_path / "c.toml"
    path.write_text("num_clients = 50\nlr = 0.05\n")
    config = load_config(path, ['partition={method="iid"}', "train={batch_size=5}"])
    assert (config.partition.num_clients, config.partition.method) == (50, "iid")
    assert (config.train.lr, config.train.batch_size) == (0.05, 5)
    with pytest.raises(ConfigError, match=r"train\.lr: must be > 0"):
        load_config(path, ["train={lr=-1}"])


def test_every_flat_alias_names_a_field_of_its_section():
    """The aliases are the keys users typed before the sections (a fixed list); each must still land
    on a field, so that renaming a field cannot silently break old configs."""
    from pflkit.config import FLAT_KEYS, ExperimentConfig

    for key, (section, field) in FLAT_KEYS.items():
        assert field in ExperimentConfig.model_fields[section].annotation.model_fields, (key, section, field)

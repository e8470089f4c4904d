"""Config parsing, overrides and the shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from pflkit.config import ConfigError, load_config, parse_override, split_overrides, to_dict

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


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    cfg = load_config(path, ["data_dir='/somewhere'"])
    assert cfg.rounds >= 1


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

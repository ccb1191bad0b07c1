"""Algorithm-owned run-config keys: declarations, how unknown keys are treated, and the listings
(``fedpriv algorithms``, README tables, ``[tool.flwr.app.config]``) read from them."""

from pathlib import Path

import pytest

from fedpriv.algorithms.catalogue import BUILTIN
from fedpriv.cli import main
from fedpriv.config import CORE, ConfigError, RunConfig, resumable_keys, select_keys
from fedpriv.config_files import toml_value
from fedpriv.keys import README_BEGIN, README_END, markdown_tables
from fedpriv.params import Param, ParamGroup, merge_params

ROOT = Path(__file__).resolve().parents[1]


def test_every_builtin_declares_its_keys_once_and_none_redeclares_a_core_key():
    core = {p.key for p in CORE.params}
    for cls in BUILTIN:
        declared = cls.declared_params()
        assert declared and not core & set(declared), cls.name
        for param in declared.values():
            assert param.parse(param.default) == param.default  # defaults are allowed values


def test_two_different_declarations_of_one_key_are_refused():
    a = ParamGroup("a", (Param("x-key", float, 1.0, "one"),))
    b = ParamGroup("b", (Param("x-key", float, 2.0, "another"),))
    with pytest.raises(ValueError, match="x-key: declared twice"):
        merge_params([a, b])


def test_a_config_holds_exactly_the_core_keys_and_the_algorithms_own():
    config = RunConfig.from_mapping({"algorithm": "priv-altmin", "user-groups": 5})
    assert config.user_groups == 5 and config.has("feature-clip")
    assert set(config.to_mapping()) == {p.key for p in CORE.params} | set(
        type_of("priv-altmin").declared_params())
    with pytest.raises(AttributeError, match="'batch-size' is not a key of algorithm"):
        _ = config.batch_size


def type_of(name):
    from fedpriv.registry import get_algorithm

    return get_algorithm(name)


def test_strict_parsing_refuses_another_algorithms_key_naming_the_algorithm_and_its_keys():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['batch-size'\] for algorithm "
                                          r"'priv-altmin'; its keys: dim, rank"):
        RunConfig.from_mapping({"algorithm": "priv-altmin", "batch-size": "max"}, strict=True)


def test_a_flower_run_config_may_carry_other_keys_at_their_defaults_but_not_set_ones():
    every = {"algorithm": "meta-nsgd", "batch-size": "max", "candidates": 2000,
             "some-other-component": 3}
    assert RunConfig.from_mapping(every).algorithm == "meta-nsgd"  # defaults: ignored
    with pytest.raises(ConfigError, match="candidates: not a key of algorithm 'meta-nsgd', so "
                                          "the value 10 would do nothing"):
        RunConfig.from_mapping({**every, "candidates": 10})


def test_plugin_config_carries_keys_as_a_toml_table_and_is_checked_strictly():
    config = RunConfig.from_mapping({"algorithm": "priv-altmin",
                                     "plugin-config": "{ feature-clip = 3.5 }"})
    assert config.feature_clip == 3.5
    with pytest.raises(ConfigError, match=r"plugin-config: unknown key\(s\) \['clip-norm'\]"):
        RunConfig.from_mapping({"algorithm": "priv-altmin",
                                "plugin-config": "{ clip-norm = 1.0 }"})
    with pytest.raises(ConfigError, match="not a TOML inline table"):
        RunConfig.from_mapping({"plugin-config": "feature-clip = 3"})
    with pytest.raises(ConfigError, match="also given directly"):
        RunConfig.from_mapping({"algorithm": "priv-altmin", "feature-clip": 2.0,
                                "plugin-config": "{ feature-clip = 3.5 }"})


def test_select_keys_keeps_what_the_algorithm_reads():
    shared = {"algorithm": "meta-local", "clip-norm": 2.0, "meta-lambda": 0.1, "seed": 3}
    assert select_keys(shared) == {"algorithm": "meta-local", "meta-lambda": 0.1, "seed": 3}


def test_only_operational_keys_may_change_on_resume():
    assert resumable_keys() == {"results-path", "node-timeout", "max-epsilon", "checkpoint",
                                "checkpoint-path", "resume", "users-per-node",
                                "node-fault-rate", "node-fault-kind"}


def test_fedpriv_algorithms_lists_every_algorithm_with_its_keys_and_defaults(capsys):
    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    for cls in BUILTIN:
        assert f"\n{cls.name}" in out
        for key, param in cls.declared_params().items():
            assert f"{key}={toml_value(param.default)}" in out
    assert "FedRep rounds: learning-rate=1.0, clip-norm=0.5, clipping=true, batch-size=\"max\"" \
        in out
    assert main(["algorithms", "priv-altmin"]) == 0
    assert "cov-budget-share = 0.5  share of a round's privacy loss" in capsys.readouterr().out
    assert main(["algorithms", "no-such"]) == 2


def test_the_readme_key_tables_are_the_rendering_of_the_declarations():
    text = (ROOT / "README.md").read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    assert text[start:end] == markdown_tables(), \
        "regenerate the README section with: fedpriv algorithms --markdown"

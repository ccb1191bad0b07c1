import pytest

from fedpriv.config import ConfigError
from fedpriv.configure import parse_config


@pytest.mark.parametrize("override,key", [
    ({"epsilon": 0}, "epsilon"),
    ({"epsilon": -1.0}, "epsilon"),
    ({"delta": 1.0}, "delta"),
    ({"delta": 0.0}, "delta"),
    ({"rank": 30, "dim": 20}, "rank"),
    ({"samples-per-user": 3}, "samples-per-user"),
    ({"samples-per-user": 6, "batch-size": "3"}, "batch-size"),
    ({"algorithm": "nope"}, "algorithm"),
    ({"feature-dist": "cauchy"}, "feature-dist"),
    ({"accountant": "moments"}, "accountant"),
    ({"neighbouring-relation": "swap"}, "neighbouring-relation"),
    ({"num-users": "many"}, "num-users"),
    ({"rounds": 2.5}, "rounds"),
])
def test_invalid_values_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        parse_config(override)


def test_unknown_keys_fail_in_strict_mode_only():
    with pytest.raises(ConfigError, match="unknown key.*did you mean 'epsilon' for 'epsilonn'"):
        parse_config({"epsilonn": 1.0}, strict=True)
    with pytest.raises(ConfigError, match="unknown key") as err:
        parse_config({"zzz-nothing-alike": 1.0}, strict=True)
    assert "did you mean" not in str(err.value)
    assert parse_config({"other-component-key": 1}).epsilon == 1.0


def test_defaults_round_trip():
    config = parse_config({})
    assert parse_config(config.to_mapping()) == config


def test_the_flower_app_config_is_the_rendering_of_the_declarations():
    import tomllib
    from pathlib import Path

    from fedpriv.keys import app_config

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    assert declared == app_config(), "regenerate with: fedpriv algorithms --flwr-config"


@pytest.mark.parametrize(("name", "command"), [("figure_fmnist_label_skew.toml", "sweep"),
                                               ("tune_private_fedrep.toml", "tune")])
def test_a_sweep_or_tuning_file_given_to_run_names_the_command_to_use(name, command):
    from pathlib import Path

    from fedpriv.config_files import load_run_config

    path = Path(__file__).resolve().parents[1] / "configs" / name
    with pytest.raises(ConfigError, match=f"is a {command} file .*`fedpriv {command} "):
        load_run_config(str(path), [])


@pytest.mark.parametrize("algorithm", ["private-fedrep", "meta-nsgd", "a-exp", "jl-exp",
                                       "deep-private-fedrep", "local-only"])
def test_the_core_relations_are_checked_whatever_the_algorithms_components(algorithm):
    """A component's own check_keys never hides the core's (a fixed noise seed with secure
    noise would make the noise predictable)."""
    with pytest.raises(ConfigError, match="noise-seed: 3 is not allowed with secure-noise"):
        parse_config({"algorithm": algorithm, "secure-noise": True, "noise-seed": 3})
    with pytest.raises(ConfigError, match="users-per-node: 50 exceeds num-users"):
        parse_config({"algorithm": algorithm, "num-users": 10, "users-per-node": 50})

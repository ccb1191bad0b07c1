"""Algorithm-owned run-config keys: declarations, how unknown keys are treated, and the listings
(``fedpriv algorithms``, README tables, ``[tool.flwr.app.config]``) read from them."""

from pathlib import Path

import pytest

from fedpriv.algorithms.catalogue import BUILTIN
from fedpriv.cli import main
from fedpriv.config import CORE, ConfigError, resumable_keys
from fedpriv.config_files import toml_value
from fedpriv.configure import config_defaults, parse_config, select_keys
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
    config = parse_config({"algorithm": "priv-altmin", "user-groups": 5})
    assert config.user_groups == 5 and config.has("feature-clip")
    assert set(config.to_mapping()) == {p.key for p in CORE.params} - {"plugin-config"} | set(
        type_of("priv-altmin").declared_params())
    with pytest.raises(AttributeError, match="has no attribute 'batch_size'"):
        _ = config.batch_size


def type_of(name):
    from fedpriv.registry import get_algorithm

    return get_algorithm(name)


def test_strict_parsing_refuses_another_algorithms_key_naming_the_algorithm_and_its_keys():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['batch-size'\] for algorithm "
                                          r"'priv-altmin'; its keys: dim, rank"):
        parse_config({"algorithm": "priv-altmin", "batch-size": "max"}, strict=True)


def test_a_flower_run_config_may_carry_other_keys_at_their_defaults_but_not_set_ones():
    every = {"algorithm": "meta-nsgd", "batch-size": "max", "candidates": 2000,
             "some-other-component": 3}
    assert parse_config(every).algorithm == "meta-nsgd"  # defaults: ignored
    with pytest.raises(ConfigError, match="candidates: not a key of algorithm 'meta-nsgd', so "
                                          "the value 10 would do nothing"):
        parse_config({**every, "candidates": 10})


def test_plugin_config_carries_keys_as_a_toml_table_and_is_checked_strictly():
    config = parse_config({"algorithm": "priv-altmin",
                                     "plugin-config": "{ feature-clip = 3.5 }"})
    assert config.feature_clip == 3.5
    with pytest.raises(ConfigError, match=r"plugin-config: unknown key\(s\) \['clip-norm'\]"):
        parse_config({"algorithm": "priv-altmin",
                                "plugin-config": "{ clip-norm = 1.0 }"})
    with pytest.raises(ConfigError, match="not a TOML inline table"):
        parse_config({"plugin-config": "feature-clip = 3"})
    with pytest.raises(ConfigError, match="also given directly"):
        parse_config({"algorithm": "priv-altmin", "feature-clip": 2.0,
                                "plugin-config": "{ feature-clip = 3.5 }"})


def test_select_keys_keeps_what_the_algorithm_reads():
    shared = {"algorithm": "meta-local", "clip-norm": 2.0, "meta-lambda": 0.1, "seed": 3}
    assert select_keys(shared) == {"algorithm": "meta-local", "meta-lambda": 0.1, "seed": 3}


def test_only_operational_keys_may_change_on_resume():
    assert resumable_keys() == {"results-path", "node-timeout", "max-epsilon", "checkpoint",
                                "checkpoint-path", "resume", "users-per-node",
                                "node-fault-rate", "node-fault-kind", "size-check"}


def test_fedpriv_algorithms_lists_every_algorithm_with_its_keys_and_defaults(capsys):
    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    for cls in BUILTIN:
        assert f"\n{cls.name}" in out
        for key, param in cls.declared_params().items():
            assert f"{key}={toml_value(cls.default_of(param))}" in out
    assert "FedRep rounds: learning-rate=1.0, clip-norm=0.5, clipping=true, batch-size=\"max\"" \
        in out
    assert main(["algorithms", "priv-altmin"]) == 0
    assert "cov-budget-share = 0.5  share of a round's privacy loss" in capsys.readouterr().out
    assert main(["algorithms", "no-such"]) == 2


def test_the_key_reference_tables_are_the_rendering_of_the_declarations():
    text = (ROOT / "docs" / "reference" / "keys.md").read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    assert text[start:end] == markdown_tables(), \
        "regenerate the docs/reference/keys.md section with: fedpriv algorithms --markdown"


def test_a_key_is_one_declaration_across_every_builtin():
    seen: dict[str, Param] = {}
    for cls in BUILTIN:
        for key, param in cls.declared_params().items():
            assert seen.setdefault(key, param) is param, f"{key}: two declarations"


TINY = {"num-users": 60, "rounds": 2, "epsilon": 8.0, "test-samples-per-user": 2, "dim": 6,
        "candidates": 20, "jl-dim": 2, "cover-radius": 0.5}
VARIANTS = [(cls.name, {}) for cls in BUILTIN] + [
    ("private-fedrep", {"init": "pairs"}), ("private-fedrep", {"init": "random"}),
    ("priv-altmin", {"init": "u-statistic", "user-groups": 2}),
    ("fedrep", {"clipping": False}), ("meta-cluster", {"meta-models": 3, "task-clusters": 3}),
    ("meta-nsgd", {"task-loss": "logistic"}), ("local-only", {"feature-dist": "mixed"}),
]


@pytest.mark.parametrize("name,extra", VARIANTS,
                         ids=[f"{n}-{'-'.join(map(str, e.values())) or 'default'}"
                              for n, e in VARIANTS])
def test_every_builtin_runs_end_to_end_on_the_keys_it_declares(name, extra):
    """An algorithm reads its keys as attributes; an undeclared read would fail here."""
    from fedpriv.engine import run_in_process

    family = {"rank": 1} if name.startswith("jl-exp") else {}
    if name.startswith(("meta", "private-meta", "dp-ftmrl", "ftmrl")) or name.startswith("jl"):
        family["feature-dist"] = "unit-ball"
    values = {**select_keys({**TINY, **family, "algorithm": name}), **extra}
    results = run_in_process(parse_config(values, strict=True), log=lambda _: None)
    assert results["config"] == parse_config(values).to_mapping()
    assert results["metrics"] and all(v == v for v in results["metrics"].values())  # no NaN


def test_plugin_config_and_direct_keys_give_the_same_config_on_every_engine():
    direct = parse_config({"algorithm": "priv-altmin", "feature-clip": 3.5})
    carried = parse_config({"algorithm": "priv-altmin",
                                      "plugin-config": "{ feature-clip = 3.5 }"})
    assert carried.to_mapping() == direct.to_mapping()
    assert "plugin-config" not in direct.to_mapping()
    with pytest.raises(ConfigError, match=r"plugin-config: unknown key\(s\) \['epsilon'\]"):
        parse_config({"plugin-config": "{ epsilon = 100.0 }"})


def test_plug_in_keys_reach_flower_in_plugin_config_that_flower_parses():
    from flwr.common.config import parse_config_args

    from fedpriv.config_files import for_flower
    from fedpriv.deploy.commands import run_config_string

    values = {"algorithm": "toy", "seed": 3, "toy-mode": "fast", "toy-scale": 2.5}
    moved = for_flower(values, {"algorithm", "seed", "plugin-config"})
    assert moved == {"algorithm": "toy", "seed": 3,
                     "plugin-config": "{ toy-mode = 'fast', toy-scale = 2.5 }"}
    assert parse_config_args([run_config_string(moved)]) == moved
    assert for_flower(values, None) == values  # no app table readable: unchanged
    with pytest.raises(ConfigError, match="toy-mode: a plug-in key's string value"):
        for_flower({**values, "toy-mode": "it's"}, {"algorithm", "seed"})


def test_switching_a_files_algorithm_keeps_the_keys_the_new_one_reads(capsys):
    from fedpriv.config_files import load_run_config

    values = load_run_config(str(ROOT / "configs" / "private_fedrep.toml"),
                             ["algorithm=priv-altmin", "init=pairs"])
    assert "batch-size" not in values and values["num-users"] == 20000
    assert "priv-altmin does not read ['batch-size'" in capsys.readouterr().err
    parse_config(values, strict=True)
    with pytest.raises(ConfigError, match="batch-size"):  # what --set names stays strict
        parse_config(load_run_config(None, ["algorithm=priv-altmin",
                                                      "batch-size=2"]), strict=True)


def test_a_checkpoint_from_before_algorithm_owned_keys_still_matches():
    from fedpriv.server.store import changed_keys

    wanted = parse_config({"algorithm": "priv-altmin"}).to_mapping()
    old = {**wanted, "batch-size": "max", "candidates": 2000, "meta-lambda": 0.05,
           "plugin-config": ""}  # the old format held every family's keys
    assert changed_keys(old, wanted) == []
    assert changed_keys({**old, "feature-clip": 3.0}, wanted) == ["feature-clip"]
    config = parse_config({"algorithm": "priv-altmin"})
    before = {k: v for k, v in wanted.items() if k != "private-metrics"}  # a key added later
    assert changed_keys(before, wanted, config_defaults(config)) == []
    assert changed_keys(before, {**wanted, "private-metrics": True}, config_defaults(config)) == [
        "private-metrics"]


class _EntryPoint:
    def __init__(self, name, target):
        self.name, self.value, self._target = name, f"tests:{name}", target

    def load(self):
        return self._target()


def _conflicting():
    from fedpriv.algorithms.base import Algorithm

    class Conflicting(Algorithm):
        name = "conflicting"
        components = (ParamGroup("own", (Param("clip-norm", float, 3.0, "another meaning"),)),)
    return Conflicting


def _broken():
    raise ModuleNotFoundError("No module named 'missing_dependency'")


def test_a_broken_or_conflicting_plugin_is_reported_and_does_not_stop_other_runs(monkeypatch):
    from fedpriv import registry

    registry.available()  # the built-ins first
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_FAILED", {})
    monkeypatch.setattr(registry, "_loaded", {"builtins": True, "entry_points": False})
    monkeypatch.setattr(registry, "entry_points", lambda group: [
        _EntryPoint("broken", _broken), _EntryPoint("conflicting", _conflicting)])
    with pytest.warns(UserWarning) as caught:
        names = registry.available()
    assert sorted(str(w.message).split("'")[1] for w in caught) == ["broken", "conflicting"]
    assert "broken" not in names and "conflicting" not in names
    assert "declares clip-norm differently" in registry._FAILED["conflicting"]
    assert parse_config({"algorithm": "a-exp"}, strict=True).algorithm == "a-exp"
    with pytest.raises(ConfigError, match="missing_dependency"):
        parse_config({"algorithm": "broken"})


# ----- per-algorithm defaults ------------------------------------------------------------------
PER_ALGORITHM = ("rounds", "learning-rate", "clip-quantile")


def test_per_algorithm_keys_resolve_to_each_algorithms_own_default():
    """A key whose good value depends on the algorithm (``rounds``, say) holds a placeholder;
    the run config holds the algorithm's own value, the same whether the key is absent or
    given as the placeholder (as Flower's app config gives every key)."""
    deep = parse_config({"algorithm": "deep-dp-fedavg-ft", "num-users": 200})
    assert (deep.rounds, deep.learning_rate, deep.clip_quantile) == (10, 0.25, 0.5)
    flwr_like = parse_config({"algorithm": "deep-private-fedrep", "num-users": 200,
                                        "rounds": 0, "learning-rate": 0.0,
                                        "clip-quantile": -1.0})
    assert (flwr_like.rounds, flwr_like.learning_rate, flwr_like.clip_quantile) == (
        10, 0.25, 0.5)
    fedrep = parse_config({"algorithm": "deep-fedrep", "num-users": 200})
    assert (fedrep.rounds, fedrep.learning_rate, fedrep.clip_quantile) == (40, 2.0, 0.0)
    linear = parse_config({"algorithm": "private-fedrep"})  # the fallbacks
    assert (linear.rounds, linear.learning_rate) == (5, 1.0)
    given = parse_config({"algorithm": "deep-dp-fedavg-ft", "num-users": 200,
                                    "rounds": 7, "learning-rate": 0.5, "clip-quantile": 0.0})
    assert (given.rounds, given.learning_rate, given.clip_quantile) == (7, 0.5, 0.0)
    assert config_defaults(deep)["rounds"] == 10 and config_defaults(linear)["rounds"] == 5
    # the private deep rounds follow epsilon x the population / 50, within 10..40
    for users, epsilon, rounds in ((200, 1, 10), (1000, 1, 20), (2000, 1, 40), (6000, 1, 40),
                                   (2000, 0.5, 20), (2000, 8, 40), (1000, 0.1, 10)):
        assert parse_config({"algorithm": "deep-private-fedrep", "num-users": users,
                                       "epsilon": epsilon, "dataset": "fashion-mnist"}
                                      ).rounds == rounds
    assert parse_config({"algorithm": "deep-fedrep", "num-users": 200}).rounds == 40
    assert deep.to_mapping()["rounds"] == 10  # the results file holds what ran
    # the local steps: DP-FedAvg's own (5 of 0.05), everyone else's the fallback (1 of 0.1)
    assert (deep.body_steps, deep.local_lr) == (5, 0.05)
    assert deep.to_mapping()["body-steps"] == 5 and deep.to_mapping()["local-lr"] == 0.05
    for name in ("deep-private-fedrep", "deep-fedrep", "deep-fedavg-ft"):
        other = parse_config({"algorithm": name, "num-users": 200})
        assert (other.body_steps, other.local_lr) == (1, 0.1), name
    assert parse_config({"algorithm": "deep-local-only", "num-users": 200}).local_lr == 0.1
    one = parse_config({"algorithm": "deep-dp-fedavg", "num-users": 200, "body-steps": 1,
                        "local-lr": 0.1})
    assert (one.body_steps, one.local_lr) == (1, 0.1)


def test_every_builtin_default_is_a_working_value():
    """No algorithm resolves a per-algorithm key to its placeholder or outside its range."""
    for cls in BUILTIN:
        for param in (*CORE.params, *cls.declared_params().values()):
            if not param.per_algorithm:
                continue
            for users in (1, 60, 1000, 2000, 10**7):
                core = {"num_users": users, "epsilon": 1.0, "delta": 1e-6}
                value = cls.default_of(param, core)
                assert value != param.default, (cls.name, param.key)
                assert param.parse(value) == value
        assert set(cls.defaults) <= {p.key for p in CORE.params} | set(cls.declared_params()), \
            cls.name


def test_key_tables_say_what_a_per_algorithm_placeholder_means():
    tables = markdown_tables()
    assert ("| `rounds` | `0`: 5; deep-private-fedrep, deep-dp-fedavg, deep-dp-fedavg-ft: "
            "epsilon x num-users / 50, within 10..40; deep-fedrep, deep-fedavg-ft, "
            "fewshot-dp-reptile: 40; fewshot-meta-nsgd, fewshot-meta-sgd, "
            "fewshot-private-meta-cluster, fewshot-meta-cluster, fewshot-dp-ftmrl, "
            "fewshot-ftmrl: 80 |") in tables
    assert ("deep-private-fedrep, deep-dp-fedavg, deep-dp-fedavg-ft, fewshot-meta-nsgd, "
            "fewshot-meta-sgd, fewshot-private-meta-cluster, fewshot-meta-cluster, "
            "fewshot-dp-ftmrl, fewshot-ftmrl: 0.25; deep-fedrep: 2.0") in tables

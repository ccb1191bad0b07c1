"""Parse a run-config mapping (kebab-case keys) into the chosen algorithm's typed config.

``parse_config`` reads the core keys, finds the algorithm in the registry and builds its config
class (``Algorithm.config_type``): every value is coerced and range-checked, then the relations
between keys are checked (the core's, each component's, the algorithm's own), so a bad value
fails before any user is touched, with a message naming the key and what is allowed.

Unknown keys:

* ``strict`` (the CLI, sweeps): a key the chosen algorithm does not declare is refused, naming
  the algorithm and its keys; so is a key only a node sets for itself (``data-part``, which the
  ClientApp sets where a SuperNode's node config names its own data-file).
* not strict (a Flower run-config, which carries the defaults of every built-in component from
  ``[tool.flwr.app.config]``): a key another component declares is ignored while it holds its
  default and refused when it is set (it would silently do nothing); a key nobody declares is
  ignored (it may belong to another Flower component).

A plug-in algorithm's keys are not in the app's ``[tool.flwr.app.config]``, and Flower refuses
override keys that are not there; they travel in the core key ``plugin-config``, a TOML inline
table (``fedpriv run`` fills it), and are always checked strictly.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from fedpriv.algorithms.base import Algorithm
from fedpriv.config import _CORE, CORE, PLUGIN_CONFIG, RunConfig
from fedpriv.evaluation import check
from fedpriv.params import ConfigError, Param
from fedpriv.registry import available, declared, get_algorithm

__all__ = ["algorithm_params", "config_defaults", "declared_keys", "parse_config",
           "select_keys"]

NODE_KEYS = ("data-part",)  # set by a node for itself, never by a user's run config


def algorithm_of(name: str) -> type[Algorithm[Any]]:
    """The registered algorithm ``name``; ``ConfigError`` naming the key if there is none."""
    try:
        return get_algorithm(name)
    except KeyError as err:
        raise ConfigError(f"algorithm: {err.args[0]}") from None


def algorithm_params(name: str) -> dict[str, Param]:
    """The keys the registered algorithm ``name`` declares, besides the core ones."""
    return algorithm_of(name).declared_params()


def parse_config(values: Mapping[str, Any], strict: bool = False) -> RunConfig:
    """Parse and validate (see the module docstring for how unknown keys are treated)."""
    values = dict(values)
    plugin = _plugin_values(values.get(PLUGIN_CONFIG, ""))
    clash = sorted(set(plugin) & {k for k in values if k != PLUGIN_CONFIG})
    if clash:
        raise ConfigError(f"{PLUGIN_CONFIG}: {clash} also given directly; give each key once")
    core = {p.attr: p.parse(values.get(p.key, p.default)) for p in CORE.params}
    cls = algorithm_of(core["algorithm"])
    own = cls.declared_params()
    core = {p.attr: _resolved(cls, p, core[p.attr], core) for p in CORE.params}
    overlap = sorted(set(own) & set(_CORE))
    if overlap:
        raise ConfigError(f"algorithm: {core['algorithm']} redeclares core key(s) {overlap}")
    _check_unknown(core["algorithm"], own, values, plugin, strict)
    given = {**values, **plugin}
    for key in NODE_KEYS if strict else ():
        if str(given.get(key, "")).strip():
            raise ConfigError(f"{key}: set by the ClientApp of a SuperNode whose node "
                              "config names its own data-file (it then reads only its "
                              "users' rows); a run config does not set it")
    params = {p.attr: _resolved(cls, p, p.parse(given.get(p.key, p.default)), core)
              for p in own.values()}
    config = cls.config_type(**core, **params)
    RunConfig.check_keys(config)  # the core's relations (components' own: in validate)
    if getattr(cls, "partitions_in_validate", False):  # its validate cuts users' partition
        from fedpriv.cost import check_size

        check_size(config, machine=False)  # steps and time first: absurd sizes never cut
    cls.validate(config)
    resolved: RunConfig = cls.resolved(config)
    check(resolved, cls)
    return resolved


def config_defaults(config: RunConfig) -> dict[str, Any]:
    """The default of every key of ``config``'s run (core and the algorithm's own),
    per-algorithm defaults resolved for its algorithm and core keys."""
    cls = algorithm_of(config.algorithm)
    core = {p.attr: getattr(config, p.attr) for p in CORE.params}
    return {p.key: cls.default_of(p, core) for p in (*CORE.params, *cls.declared_params().values())}


def _resolved(cls: type[Algorithm[Any]], param: Param, value: Any,
              core: Mapping[str, Any]) -> Any:
    """``value``, or the algorithm's own default where it is a per-algorithm key's placeholder
    (a rule computed from the run's ``core`` keys)."""
    if param.per_algorithm and value == param.default:
        return cls.default_of(param, core)
    return value


def select_keys(values: Mapping[str, Any], algorithm: str | None = None) -> dict[str, Any]:
    """``values`` restricted to the core keys and the keys ``algorithm`` (default: the one
    ``values`` names) declares: for settings shared by several algorithms, such as a sweep's
    ``[base]`` table, where a key one algorithm does not read is not an error."""
    name = algorithm or values.get("algorithm", _CORE["algorithm"].default)
    own = algorithm_params(name)
    return {k: v for k, v in values.items() if k in _CORE or k in own}


def _plugin_values(text: Any) -> dict[str, Any]:
    if not isinstance(text, str):
        raise ConfigError(f"{PLUGIN_CONFIG}: expected a TOML inline table in a string, got "
                          f"{text!r}")
    if not text.strip():
        return {}
    try:
        return dict(tomllib.loads(f"v = {text}")["v"])
    except (tomllib.TOMLDecodeError, TypeError, ValueError):
        raise ConfigError(f"{PLUGIN_CONFIG}: {text!r} is not a TOML inline table such as "
                          "'{ my-key = 1.5 }'") from None


def _check_unknown(algorithm: str, own: Mapping[str, Param], values: Mapping[str, Any],
                   plugin: Mapping[str, Any], strict: bool) -> None:
    known = set(_CORE) | set(own)
    listing = f"its keys: {', '.join(own) or 'none'} (and the core keys)"
    foreign = sorted(set(plugin) - set(own))  # core keys are given directly, never in it
    if foreign:
        raise ConfigError(f"{PLUGIN_CONFIG}: unknown key(s) {foreign} for algorithm "
                          f"{algorithm!r}; {listing}")
    unknown = sorted(set(values) - known)
    if not unknown:
        return
    others = declared_keys()
    if strict:
        hints = [f"{k} is read by {_few(others[k][1])}" for k in unknown if k in others]
        hints += [f"did you mean {close[0]!r} for {k!r}?" for k in unknown if k not in others
                  for close in [difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.75)]
                  if close]
        raise ConfigError(f"unknown key(s) {unknown} for algorithm {algorithm!r}; {listing}"
                          + (f" ({'; '.join(hints)})" if hints else ""))
    for key in unknown:
        param = others[key][0] if key in others else None
        if param is not None and param.parse(values[key]) != param.default:
            raise ConfigError(f"{key}: not a key of algorithm {algorithm!r}, so the value "
                              f"{values[key]!r} would do nothing; {listing}")


def _few(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def declared_keys() -> dict[str, tuple[Param, list[str]]]:
    """Every key some registered algorithm declares: its declaration (one per key: the registry
    enforces it) and the algorithms that read it. Cached per registry state, because a Flower
    node parses the run-config on every message."""
    return _declared_keys(tuple(available()))


@lru_cache(maxsize=4)
def _declared_keys(names: tuple[str, ...]) -> dict[str, tuple[Param, list[str]]]:
    keys: dict[str, tuple[Param, list[str]]] = {}
    for name in names:
        for key, param in declared(name).declared_params().items():
            keys.setdefault(key, (param, []))[1].append(name)
    return keys

"""One frozen, validated config per run, parsed from a Flower run-config (kebab-case keys).

The keys every run has (the algorithm, the users, the privacy target and accountant, rounds,
seed, the runtime and reliability keys) are declared here in ``CORE``. Everything else belongs
to the chosen algorithm, which declares its keys next to its code (``Algorithm.components``; see
``fedpriv.params``). ``RunConfig.from_mapping`` parses both, so a bad value fails before any user
is touched, with a message naming the key and what is allowed.

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
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

from fedpriv.faults import FAULT_KINDS
from fedpriv.params import (
    ConfigError,
    Param,
    ParamGroup,
    finite,
    non_negative,
    one_of,
    positive,
    unit_open,
)
from fedpriv.privacy.accounting import ACCOUNTANTS, NEIGHBOURING_RELATIONS

__all__ = ["CORE", "ConfigError", "RunConfig", "algorithm_params", "default_mapping",
           "resumable_keys", "select_keys"]

PLUGIN_CONFIG = "plugin-config"
METRICS_SPLITS = ("test", "validation")

CORE = ParamGroup("every run", (
    Param("algorithm", str, "private-fedrep", "registered algorithm name (`fedpriv algorithms` "
          "lists them with their keys)"),
    Param("num-users", int, 2000, "number of users n (tasks, in meta-learning)", positive,
          "an integer >= 1"),
    Param("epsilon", float, 1.0, "target epsilon of the whole run (every release)",
          lambda x: x > 0 and finite(x), "a finite number > 0"),
    Param("delta", float, 1e-6, "target delta of the whole run", unit_open,
          "a number in (0, 1)"),
    Param("accountant", str, "pld", "`pld` (dp-accounting's PLD, tight) or `rdp`",
          *one_of(ACCOUNTANTS)),
    Param("neighbouring-relation", str, "add-remove", "user-level neighbouring relation: "
          "`add-remove` or `replace-one` user", *one_of(NEIGHBOURING_RELATIONS)),
    Param("rounds", int, 0, "rounds T; `0` = the algorithm's own default", non_negative,
          "an integer >= 1 (0: the algorithm's default)", fallback=5),
    Param("seed", int, 0, "run seed: data, batches and noise all derive from it",
          non_negative, "an integer >= 0", public=False),
    Param("users-per-node", int, 0, "users per SuperNode; 0 = auto (<= 10 nodes, cohorts >= 100 "
          "users); 1 = one device per user", non_negative, "an integer >= 0", resumable=True),
    Param("results-path", str, "results/fedpriv-operator-report.json", "the operator report "
          "(exact; not private); the release goes beside it as <name>.release.json",
          resumable=True, public=False),
    Param("node-timeout", float, 600.0, "seconds to wait for node replies in a step (node "
          "discovery waits at least 120 s)", positive, "a number > 0", resumable=True),
    Param("max-epsilon", float, 0.0, "budget ceiling: a run (or resumed run) whose releases "
          "would compose to more refuses to start; 0 = the target epsilon is the ceiling",
          lambda x: x >= 0 and finite(x), "a finite number >= 0", resumable=True),
    Param("secure-noise", bool, False, "privacy noise from an OS-entropy-seeded generator (not "
          "reproducible); refuses a fixed noise-seed"),
    Param("noise-seed", int, -1, "seed of the privacy noise only; -1 = derived from seed",
          lambda x: x >= -1, "an integer >= -1", public=False),
    Param("node-fault-rate", float, 0.0, "simulated faults: the fraction of nodes (rounded "
          "down) that fail in every step, drawn per step from the seed",
          lambda x: 0 <= x < 1, "a number in [0, 1)", resumable=True),
    Param("node-fault-kind", str, "crash", "simulated faults: `crash` (error reply), `timeout` "
          "(answer after node-timeout) or `corrupt` (NaN sums)", *one_of(FAULT_KINDS),
          resumable=True),
    Param("rescale-missing-nodes", bool, True, "multiply a Gaussian release by (users hosted) / "
          "(users hosted by the nodes that answered), after the noise (post-processing; "
          "privacy unchanged)"),
    Param("checkpoint", bool, True, "save the server state after every step (atomically) so an "
          "interrupted run can be resumed", resumable=True),
    Param("checkpoint-path", str, "", "checkpoint file; `\"\"` = the results path with suffix "
          "`.checkpoint`", resumable=True, public=False),
    Param("resume", bool, False, "continue from the checkpoint (`fedpriv run --resume` sets it)",
          resumable=True, public=False),
    Param("private-metrics", bool, False, "release the final evaluation (each user's clipped "
          "test loss, or accuracy) with Gaussian noise as one more planned, accounted release, "
          "so the release carries a private utility figure"),
    Param("metric-clip", float, 0.0, "private metrics: each user's loss is clipped to "
          "[0, metric-clip] (0-1 errors to [0, 1]); 0 = the family's bound from public "
          "problem parameters; the centred mean's sensitivity is metric-clip / (2n) "
          "(add-remove) or metric-clip / n (replace-one)", non_negative, "a number >= 0"),
    Param("metrics-budget-fraction", float, 0.1, "private metrics: share of the privacy budget "
          "(1/z^2 units) spent on the evaluation release", unit_open, "a number in (0, 1)"),
    Param("metrics-split", str, "test", "private metrics: evaluate each user's `test` points "
          "(the reported utility) or its held-back `validation` points (what `fedpriv tune` "
          "selects on)", *one_of(METRICS_SPLITS)),
    Param(PLUGIN_CONFIG, str, "", "keys of a plug-in algorithm that the Flower app's "
          "`[tool.flwr.app.config]` does not list, as a TOML inline table (`fedpriv run` fills "
          "it); checked strictly", resumable=False),
))
_CORE = {p.key: p for p in CORE.params}


def algorithm_params(name: str) -> dict[str, Param]:
    """The keys the registered algorithm ``name`` declares, besides the core ones."""
    from fedpriv.registry import get_algorithm

    try:
        return get_algorithm(name).declared_params()
    except KeyError as err:
        raise ConfigError(f"algorithm: {err.args[0]}") from None


def resumable_keys() -> frozenset[str]:
    """Keys that may change when a run is resumed (operational, never what it computes)."""
    return frozenset(p.key for p in CORE.params if p.resumable)


@dataclass(frozen=True)
class RunConfig:
    """Resolved settings of one run.

    The core keys are attributes (snake_case). The algorithm's own keys are in ``params`` and
    read the same way (``config.clip_norm``); reading a key the algorithm does not declare is an
    ``AttributeError`` that says so.
    """

    algorithm: str
    num_users: int
    epsilon: float
    delta: float
    accountant: str
    neighbouring_relation: str
    rounds: int
    seed: int
    users_per_node: int
    results_path: str
    node_timeout: float
    max_epsilon: float
    secure_noise: bool
    noise_seed: int
    node_fault_rate: float
    node_fault_kind: str
    rescale_missing_nodes: bool
    checkpoint: bool
    checkpoint_path: str
    resume: bool
    private_metrics: bool
    metric_clip: float
    metrics_budget_fraction: float
    metrics_split: str
    plugin_config: str
    params: tuple[tuple[str, Any], ...] = ()  # (key, value) of the algorithm's own keys

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "params":
            raise AttributeError(name)
        key = name.replace("_", "-")
        for k, value in self.params:
            if k == key:
                return value
        raise AttributeError(f"{key!r} is not a key of algorithm {self.algorithm!r} (its keys: "
                             f"{', '.join(k for k, _ in self.params) or 'none'})")

    def has(self, key: str) -> bool:
        """Whether ``key`` (kebab-case) is a core key or one of the algorithm's own."""
        return key in _CORE or any(k == key for k, _ in self.params)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], strict: bool = False) -> RunConfig:
        """Parse and validate (see the module docstring for how unknown keys are treated)."""
        values = dict(values)
        plugin = _plugin_values(values.get(PLUGIN_CONFIG, ""))
        clash = sorted(set(plugin) & {k for k in values if k != PLUGIN_CONFIG})
        if clash:
            raise ConfigError(f"{PLUGIN_CONFIG}: {clash} also given directly; give each key once")
        core = {p.attr: p.parse(values.get(p.key, p.default)) for p in CORE.params}
        own = algorithm_params(core["algorithm"])
        from fedpriv.registry import get_algorithm

        cls_ = get_algorithm(core["algorithm"])
        core = {p.attr: _resolved(cls_, p, core[p.attr], core) for p in CORE.params}
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
        params = tuple((p.key, _resolved(cls_, p, p.parse(given.get(p.key, p.default)), core))
                       for p in own.values())
        config = cls(**core, params=params)
        config._check_relations()
        return config

    def _check_relations(self) -> None:
        from fedpriv.registry import get_algorithm

        if self.users_per_node > self.num_users:
            raise ConfigError(f"users-per-node: {self.users_per_node} exceeds num-users "
                              f"({self.num_users})")
        if self.secure_noise and self.noise_seed >= 0:
            raise ConfigError(f"noise-seed: {self.noise_seed} is not allowed with secure-noise "
                              "= true (the noise comes from OS entropy; a fixed noise seed "
                              "would make it predictable); remove noise-seed")
        if self.max_epsilon and self.epsilon > self.max_epsilon:
            raise ConfigError(f"epsilon: the target {self.epsilon} exceeds max-epsilon "
                              f"({self.max_epsilon}); the run would spend more than allowed")
        if self.resume and not self.checkpoint:
            raise ConfigError("resume: needs checkpoint = true")
        from fedpriv.evaluation import check

        cls = get_algorithm(self.algorithm)
        cls.validate(self)
        check(self, cls)

    def defaults(self) -> dict[str, Any]:
        """The default of every key of this run (core and the algorithm's own), per-algorithm
        defaults resolved for its algorithm."""
        from fedpriv.registry import get_algorithm

        cls = get_algorithm(self.algorithm)
        core = {f.name: getattr(self, f.name) for f in fields(self)}
        return {p.key: cls.default_of(p, core)
                for p in (*CORE.params, *algorithm_params(self.algorithm).values())}

    @property
    def ceiling(self) -> float:
        """The most epsilon the run may spend: max-epsilon, or the target when it is 0."""
        return self.max_epsilon or self.epsilon

    def to_mapping(self) -> dict[str, Any]:
        """The resolved config with kebab-case keys (what goes in the results file): the core
        keys, then the algorithm's own (those that came in ``plugin-config`` too, so the same
        run has the same mapping on every engine)."""
        core = {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)
                if f.name not in ("params", "plugin_config")}  # its keys are in params
        return {**core, **dict(self.params)}


def _resolved(cls: type, param: Param, value: Any, core: Mapping[str, Any]) -> Any:
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


def default_mapping() -> dict[str, Any]:
    """The core keys with their defaults (an algorithm's own defaults come with parsing)."""
    return {p.key: p.default for p in CORE.params}


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


NODE_KEYS = ("data-part",)  # set by a node for itself, never by a user's run config


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
    from fedpriv.registry import available

    return _declared_keys(tuple(available()))


@lru_cache(maxsize=4)
def _declared_keys(names: tuple[str, ...]) -> dict[str, tuple[Param, list[str]]]:
    from fedpriv.registry import get_algorithm

    keys: dict[str, tuple[Param, list[str]]] = {}
    for name in names:
        for key, param in get_algorithm(name).declared_params().items():
            keys.setdefault(key, (param, []))[1].append(name)
    return keys

"""The keys every run has, as a frozen, typed config; every algorithm's config extends it.

``RunConfig`` holds the core keys (the algorithm, the users, the privacy target and accountant,
rounds, seed, the runtime and reliability keys), each a field declared by its ``Param``
(``fedpriv.params.key``). An algorithm family declares its own keys the same way, as component
classes that extend ``RunConfig`` (``fedpriv/algorithms/*/params.py``); an algorithm names the
class it reads (``Algorithm.config_type``), so a type checker follows every key it reads and a
misspelled key is an error before anything runs. ``fedpriv.configure.parse_config`` parses a
run-config mapping into that class, so a bad value fails before any user is touched.

This module is the bottom of the keys layer: it imports nothing from fedpriv but
``fedpriv.params`` (the registry, the algorithms and the runtime are above it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, make_dataclass
from typing import Any, ClassVar, NoReturn

from fedpriv.params import (
    ConfigError,
    Param,
    ParamGroup,
    component_params,
    finite,
    key,
    merge_params,
    non_negative,
    one_of,
    positive,
    unit_open,
)

__all__ = ["CORE", "ConfigError", "RunConfig", "component_groups", "default_mapping",
           "plugin_config_type", "resumable_keys"]

PLUGIN_CONFIG = "plugin-config"
METRICS_SPLITS = ("test", "validation")
ACCOUNTANTS = ("pld", "rdp")
NEIGHBOURING_RELATIONS = ("add-remove", "replace-one")
FAULT_KINDS = ("crash", "timeout", "corrupt")
AGGREGATIONS = ("central", "distributed", "secure")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Resolved settings of one run: the core keys (snake_case attributes). An algorithm's
    config is a subclass that adds its family's keys (``fedpriv.configure.parse_config``
    builds it)."""

    component: ClassVar[str] = "every run"

    algorithm: str = key(Param(
        "algorithm", str, "private-fedrep", "registered algorithm name (`fedpriv algorithms` "
        "lists them with their keys)"))
    num_users: int = key(Param(
        "num-users", int, 2000, "number of users n (tasks, in meta-learning)", positive,
        "an integer >= 1"))
    epsilon: float = key(Param(
        "epsilon", float, 1.0, "target epsilon of the whole run (every release)",
        lambda x: x > 0 and finite(x), "a finite number > 0"))
    delta: float = key(Param(
        "delta", float, 1e-6, "target delta of the whole run", unit_open,
        "a number in (0, 1)"))
    accountant: str = key(Param(
        "accountant", str, "pld", "`pld` (dp-accounting's PLD, tight) or `rdp`",
        *one_of(ACCOUNTANTS)))
    neighbouring_relation: str = key(Param(
        "neighbouring-relation", str, "add-remove", "user-level neighbouring relation: "
        "`add-remove` or `replace-one` user", *one_of(NEIGHBOURING_RELATIONS)))
    rounds: int = key(Param(
        "rounds", int, 0, "rounds T; `0` = the algorithm's own default", non_negative,
        "an integer >= 1 (0: the algorithm's default)", fallback=5))
    seed: int = key(Param(
        "seed", int, 0, "run seed: data, batches and noise all derive from it",
        non_negative, "an integer >= 0", public=False))
    users_per_node: int = key(Param(
        "users-per-node", int, 0, "users per SuperNode; 0 = auto (<= 10 nodes, cohorts >= 100 "
        "users); 1 = one device per user", non_negative, "an integer >= 0", resumable=True))
    results_path: str = key(Param(
        "results-path", str, "results/run.operator.json", "the operator report "
        "(exact; not private); the release goes beside it as <name>.release.json; a run "
        "never writes over another run's results (the default name is numbered: run-2, ...)",
        resumable=True, public=False))
    node_timeout: float = key(Param(
        "node-timeout", float, 600.0, "seconds to wait for node replies in a step (node "
        "discovery waits at least 120 s)", positive, "a number > 0", resumable=True))
    max_epsilon: float = key(Param(
        "max-epsilon", float, 0.0, "budget ceiling: a run (or resumed run) whose releases "
        "would compose to more refuses to start; 0 = the target epsilon is the ceiling",
        lambda x: x >= 0 and finite(x), "a finite number >= 0", resumable=True))
    secure_noise: bool = key(Param(
        "secure-noise", bool, False, "publishable noise: discrete Gaussian noise on a "
        "power-of-two grid from a cryptographic generator seeded by the OS (not reproducible); "
        "the exponential mechanism sampled exactly; needs accountant = `rdp` and no Poisson "
        "sampling by the server; refuses a fixed noise-seed"))
    aggregation: str = key(Param(
        "aggregation", str, "central", "`central` (the server adds the noise: it is trusted) "
        "or `distributed` (each node adds its share of Skellam noise to its rotated, "
        "quantized sum, modulo 2^b; the server sees each node's noisy share) or `secure` (the "
        "same shares, masked by secure aggregation: the server sees only their sum); both need "
        "accountant = `rdp` and no Poisson sampling by the server",
        *one_of(AGGREGATIONS)))
    collusion_threshold: float = key(Param(
        "collusion-threshold", float, 0.1, "distributed: the fraction of nodes (rounded down) "
        "that may drop out of a round or collude with the server; each node's noise share is "
        "sized so that the other nodes' shares alone carry the planned noise",
        lambda x: 0 <= x < 1, "a number in [0, 1) (at 1 no honest node's noise would be left)"))
    secure_threshold: int = key(Param(
        "secure-threshold", int, 0, "secure: the shares needed to rebuild a node's secrets "
        "(Shamir threshold): of all nodes (complete graph: 0 = a majority, and always more "
        "than the nodes that may collude, collusion-threshold), or of a neighbourhood "
        "(secure-neighbours: 0 = the smallest meeting the privacy target)", lambda x: x >= 0,
        "an integer >= 0 (0: automatic)"))
    secure_neighbours: int = key(Param(
        "secure-neighbours", int, 0, "secure: the neighbours each node shares keys and masks "
        "with (SecAgg+; even; the threshold then counts within a neighbourhood); 0 = the "
        "fewest that keep a round's privacy failure below 2^-40 and its completion failure "
        "below 2^-20 (collusion-threshold, secure-dropout), or every other node below 64 "
        "nodes, where that is not at least half as many, or where secure-threshold is set "
        "alone", lambda x: x >= 0,
        "an integer >= 0 (0: automatic)"))
    secure_dropout: float = key(Param(
        "secure-dropout", float, 0.1, "secure: the fraction of nodes (rounded down) that may "
        "drop out mid-round, which the neighbourhoods are sized to survive",
        lambda x: 0 <= x < 1, "a number in [0, 1)"))
    modulus_bits: int = key(Param(
        "modulus-bits", int, 0, "distributed: bits b of the modular sum (mod 2^b); 0 = the "
        "smallest b whose wrap-around probability is at most 1e-9",
        lambda x: x == 0 or 2 <= x <= 62, "0 (automatic) or an integer in [2, 62]"))
    noise_seed: int = key(Param(
        "noise-seed", int, -1, "seed of the privacy noise only; -1 = derived from seed",
        lambda x: x >= -1, "an integer >= -1", public=False))
    node_fault_rate: float = key(Param(
        "node-fault-rate", float, 0.0, "simulated faults: the fraction of nodes (rounded "
        "down) that fail in every step, drawn per step from the seed",
        lambda x: 0 <= x < 1, "a number in [0, 1)", resumable=True))
    node_fault_kind: str = key(Param(
        "node-fault-kind", str, "crash", "simulated faults: `crash` (error reply), `timeout` "
        "(answer after node-timeout) or `corrupt` (NaN sums)", *one_of(FAULT_KINDS),
        resumable=True))
    rescale_missing_nodes: bool = key(Param(
        "rescale-missing-nodes", bool, True, "multiply a Gaussian release by (users hosted) / "
        "(users hosted by the nodes that answered), after the noise (post-processing; "
        "privacy unchanged)"))
    checkpoint: bool = key(Param(
        "checkpoint", bool, True, "save the server state after every step (atomically) so an "
        "interrupted run can be resumed", resumable=True))
    checkpoint_path: str = key(Param(
        "checkpoint-path", str, "", "checkpoint file; `\"\"` = the results path with suffix "
        "`.checkpoint`", resumable=True, public=False))
    resume: bool = key(Param(
        "resume", bool, False, "continue from the checkpoint (`fedpriv run --resume` sets it)",
        resumable=True, public=False))
    private_metrics: bool = key(Param(
        "private-metrics", bool, False, "release the final evaluation (each user's clipped "
        "test loss, or accuracy) with Gaussian noise as one more planned, accounted release, "
        "so the release carries a private utility figure"))
    metric_clip: float = key(Param(
        "metric-clip", float, 0.0, "private metrics: each user's loss is clipped to "
        "[0, metric-clip] (0-1 errors to [0, 1]); 0 = the family's bound from public "
        "problem parameters; the centred mean's sensitivity is metric-clip / (2n) "
        "(add-remove) or metric-clip / n (replace-one)", non_negative, "a number >= 0"))
    metrics_budget_fraction: float = key(Param(
        "metrics-budget-fraction", float, 0.1, "private metrics: share of the privacy budget "
        "(1/z^2 units) spent on the evaluation release", unit_open, "a number in (0, 1)"))
    metrics_split: str = key(Param(
        "metrics-split", str, "test", "private metrics: evaluate each user's `test` points "
        "(the reported utility) or its held-back `validation` points (what `fedpriv tune` "
        "selects on)", *one_of(METRICS_SPLITS)))
    size_check: bool = key(Param(
        "size-check", bool, True, "before anything is allocated, refuse a run whose estimated "
        "peak memory exceeds what this machine has available, that would take more than 12 "
        "hours or that has more than 10^7 steps (the estimate reads public sizes only: "
        "`fedpriv.cost`); `false` runs it anyway", resumable=True))
    plugin_config: str = key(Param(
        PLUGIN_CONFIG, str, "", "keys of a plug-in algorithm that the Flower app's "
        "`[tool.flwr.app.config]` does not list, as a TOML inline table (`fedpriv run` fills "
        "it); checked strictly", resumable=False))

    def check_keys(self) -> None:
        """Relations between the core keys. A component class's own ``check_keys`` checks its
        keys only (``component_groups`` collects each class's own; parsing calls this one as
        ``RunConfig.check_keys(config)``), so none calls ``super()``."""
        if self.users_per_node > self.num_users:
            raise ConfigError(f"users-per-node: {self.users_per_node} exceeds num-users "
                              f"({self.num_users})")
        if self.secure_noise and self.noise_seed >= 0:
            raise ConfigError(f"noise-seed: {self.noise_seed} is not allowed with secure-noise "
                              "= true (the noise comes from OS entropy; a fixed noise seed "
                              "would make it predictable); remove noise-seed")
        discrete = [k for k, on in (("secure-noise = true", self.secure_noise),
                                    (f'aggregation = "{self.aggregation}"',
                                     self.noise_shares)) if on]
        if discrete and self.accountant != "rdp":
            raise ConfigError(f"accountant: {discrete[0]} draws discrete noise, whose guarantee "
                              "is a zCDP bound accounted with RDP (dp-accounting's PLD of a "
                              "continuous Gaussian does not cover it); set accountant = "
                              '"rdp"')
        if self.modulus_bits and not self.noise_shares:
            raise ConfigError(f"modulus-bits: {self.modulus_bits} is only used with aggregation "
                              '= "distributed" or "secure"; remove it')
        if self.secure_threshold and self.aggregation != "secure":
            raise ConfigError(f"secure-threshold: {self.secure_threshold} is only used with "
                              'aggregation = "secure"; remove it')
        if self.secure_neighbours and self.aggregation != "secure":
            raise ConfigError(f"secure-neighbours: {self.secure_neighbours} is only used with "
                              'aggregation = "secure"; remove it')
        if self.max_epsilon and self.epsilon > self.max_epsilon:
            raise ConfigError(f"epsilon: the target {self.epsilon} exceeds max-epsilon "
                              f"({self.max_epsilon}); the run would spend more than allowed")
        if self.resume and not self.checkpoint:
            raise ConfigError("resume: needs checkpoint = true")

    # ----- what moved with typed keys (a clear error for code written before) ------------------
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], strict: bool = False) -> NoReturn:
        raise AttributeError("RunConfig.from_mapping moved: use fedpriv.configure.parse_config("
                             "values, strict) (typed keys: the parsed config is the "
                             "algorithm's own config class)")

    def defaults(self) -> NoReturn:
        raise AttributeError("RunConfig.defaults() moved: use "
                             "fedpriv.configure.config_defaults(config)")

    def has(self, key: str) -> bool:
        """Whether ``key`` (kebab-case) is a key of this run (core or the algorithm's own)."""
        return key.replace("-", "_") in {f.name for f in fields(self)}

    @property
    def noise_shares(self) -> bool:
        """Each node adds its own noise share (``aggregation`` distributed or secure)."""
        return self.aggregation in ("distributed", "secure")

    @property
    def ceiling(self) -> float:
        """The most epsilon the run may spend: max-epsilon, or the target when it is 0."""
        return self.max_epsilon or self.epsilon

    def to_mapping(self) -> dict[str, Any]:
        """The resolved config with kebab-case keys (what goes in the results file): the core
        keys, then the algorithm's own in the order its components declare them (those that
        came in ``plugin-config`` too, so the same run has the same mapping on every engine)."""
        core = {p.key: getattr(self, p.attr) for p in CORE.params if p.key != PLUGIN_CONFIG}
        own = {p.key: getattr(self, p.attr) for p in own_params(type(self)).values()}
        return {**core, **own}


CORE = ParamGroup(RunConfig.component, component_params(RunConfig))
_CORE = {p.key: p for p in CORE.params}


def component_groups(config_type: type[RunConfig]) -> tuple[ParamGroup, ...]:
    """The components of an algorithm's config class, besides the core: one group per class
    of its hierarchy that declares keys (in method resolution order: a class's own bases
    first, as listed), each with the class's ``component`` name and ``check_keys``."""
    groups = []
    for klass in config_type.__mro__:
        if klass is RunConfig or not issubclass(klass, RunConfig):
            continue
        params = component_params(klass)
        if not params:
            continue
        name = klass.__dict__.get("component")
        if not isinstance(name, str):
            raise TypeError(f"{klass.__qualname__} declares keys: name its component "
                            "(component: ClassVar[str] = ...)")
        groups.append(ParamGroup(name, params, klass.__dict__.get("check_keys")))
    return tuple(groups)


_OWN: dict[type[RunConfig], dict[str, Param]] = {}


def own_params(config_type: type[RunConfig]) -> dict[str, Param]:
    """The keys of ``config_type`` besides the core ones, in declaration order (read-only:
    kept per class)."""
    own = _OWN.get(config_type)
    if own is None:
        legacy = config_type.__dict__.get("legacy_groups")
        own = merge_params(legacy if legacy is not None else component_groups(config_type))
        _OWN[config_type] = own
    return own


def plugin_config_type(name: str, base: type[RunConfig],
                       groups: Iterable[ParamGroup]) -> type[RunConfig]:
    """The config class of a plug-in that declares its keys as ``ParamGroup``s (the contract
    before typed keys): ``base`` plus a field per key it does not have yet, made at run time
    (so a type checker cannot follow them: declare a typed component class instead)."""
    groups = tuple(groups)
    have = {f.name for f in fields(base)}
    extra = [(p.attr, p.kind, key(p)) for p in merge_params(groups).values() if p.attr not in have]
    return make_dataclass(name, extra, bases=(base,), frozen=True, kw_only=True,
                          namespace={"legacy_groups": groups})


def resumable_keys() -> frozenset[str]:
    """Keys that may change when a run is resumed (operational, never what it computes)."""
    return frozenset(p.key for p in CORE.params if p.resumable)


def default_mapping() -> dict[str, Any]:
    """The core keys with their defaults (an algorithm's own defaults come with parsing)."""
    return {p.key: p.default for p in CORE.params}

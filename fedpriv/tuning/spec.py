"""The tuning file: a run config (the keys every candidate shares) with a ``[tune]`` table.

    algorithm = "private-fedrep"            # run-config keys: the base of every candidate
    num-users = 20000
    metric-clip = 0.002                     # each user's validation loss clipped to [0, B]

    [tune]
    name = "private_fedrep"                 # names the output folder (results/tune/<name>)
    epsilon = 1.0                           # total (epsilon, delta) of the WHOLE tuning
    delta = 1e-6
    method = "random-stopping"              # or "compose-all" (every candidate once, composed)
    distribution = "logarithmic"            # number of candidates K: logarithmic, geometric,
    # eta = 0.5                             #   truncated-negative-binomial (with eta), poisson
    expected-candidates = 10                # E[K]
    # search = "grid"                      # compose-all only: "grid" runs every point once,
    # candidates = 12                       #   "random" (default) this many draws
    score = "validation_mse"                # the private metric candidates are compared on
    # maximize = false                      # lower is better (the default)
    seed = 0                                # draws K, the candidates and their noise seeds;
                                            #   not allowed with secure-noise (OS entropy then)

    [tune.space]                            # run-config keys: lists, or ranges of num points
    learning-rate = [0.5, 1.0, 1.5]
    rounds = [3, 5]
    clip-norm = { low = 0.1, high = 1.0, num = 4, log = true }

The space is finite (a range is ``num`` points, evenly spaced, or log-spaced with ``log = true``;
integer keys are rounded), so each point's privacy plan can be calibrated before anything runs.
Every candidate runs with ``private-metrics = true`` and ``metrics-split = "validation"``: its
final step releases the noisy mean of its users' clipped validation losses (a deep model's:
error rates on training rows held back, ``fedpriv.algorithms.deep.problem``), the score. The keys
the tuning sets itself (``epsilon``, ``delta``, ``private-metrics``, ``metrics-split``,
``noise-seed``, ``results-path``, ``checkpoint``, ``resume``) cannot be in the space or the base
(a ``results-path`` in the base is ignored); neither can ``seed``, ``num-users``,
``neighbouring-relation`` or ``secure-noise`` vary in the space: the guarantee is about one
population under one neighbouring relation. ``--set tune.KEY=VALUE`` sets a [tune] key and
``--set tune.space.KEY=[...]`` a key of the space.

Secrecy of the draws: random stopping's bound needs K and the candidates' configurations secret.
With a seeded tuning (the default, for reproducible research) they follow from ``[tune] seed``
in this file; like the seeded noise, that makes the release not publishable (its noise is seeded
too). With ``secure-noise = true`` the draws come from OS entropy and ``[tune] seed`` is refused.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedpriv.config import CORE, ConfigError, default_mapping
from fedpriv.config_files import parse_overrides, read_config_file
from fedpriv.configure import algorithm_params, parse_config, select_keys
from fedpriv.params import Param
from fedpriv.privacy.accounting import InfeasiblePlanError
from fedpriv.privacy.selection import DISTRIBUTIONS, Repetitions

METHODS = ("random-stopping", "compose-all")
SEARCHES = ("random", "grid")
SET_BY_TUNING = ("epsilon", "delta", "private-metrics", "metrics-split", "noise-seed",
                 "results-path", "checkpoint", "checkpoint-path", "resume")
# keys the space may not vary: the guarantee is about one population (seed, num-users) under one
# neighbouring relation, and the draws' secrecy follows secure-noise
NOT_SEARCHABLE = ("seed", "num-users", "neighbouring-relation", "secure-noise")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_TUNE_KEYS = ("name", "epsilon", "delta", "method", "distribution", "eta",
              "expected-candidates", "candidates", "search", "score", "maximize", "seed",
              "space")
_RANGE_KEYS = ("low", "high", "num", "log")
_TUNE_STREAM = 0x7E


@dataclass(frozen=True)
class TuneSpec:
    """A validated tuning: its target, how candidates are chosen, and the finite space."""

    name: str
    epsilon: float
    delta: float
    method: str
    repetitions: Repetitions | None  # random stopping: the law of K
    candidates: int  # compose-all: how many candidates run (0 under random stopping)
    search: str
    score: str
    maximize: bool
    seed: int | None  # None: K and the draws come from OS entropy (secure-noise)
    base: dict[str, Any]
    space: dict[str, tuple[Any, ...]]
    points: tuple[dict[str, Any], ...]

    def candidate_values(self, point: dict[str, Any], epsilon: float,
                         noise_seed: int | None = None) -> dict[str, Any]:
        """The run config of one candidate: the base, the point, the per-candidate target and
        the private validation release."""
        values = {**self.base, **point, "epsilon": epsilon, "delta": self.delta,
                  "private-metrics": True, "metrics-split": "validation",
                  "checkpoint": False, "resume": False}
        if noise_seed is not None and not values.get("secure-noise"):
            values["noise-seed"] = int(noise_seed)
        return values

    @property
    def law(self) -> Repetitions:
        """The law of K (random stopping: ``load_tune`` always sets it)."""
        if self.repetitions is None:
            raise ValueError(f"method {self.method}: only random stopping draws K")
        return self.repetitions

    @property
    def secure(self) -> bool:
        return bool(self.base.get("secure-noise"))

    def draws(self) -> np.random.Generator:
        """The tuning's own generator (K, the candidates, their noise seeds): seeded from
        ``[tune] seed`` for reproducible research; from OS entropy with ``secure-noise``, since
        the random-stopping bound needs K and the draws secret."""
        if self.seed is None:
            return np.random.default_rng(np.random.SeedSequence())
        return np.random.default_rng([self.seed, _TUNE_STREAM])


def load_tune(path: str | Path, overrides: list[str] | None = None) -> TuneSpec:
    """Read and validate a tuning file (every point of the space parsed as a run config).
    ``overrides``: ``--set`` items; ``tune.KEY=...`` sets a [tune] key, ``tune.space.KEY=...`` a
    key of the space, anything else a base run-config key."""
    given = read_config_file(path)
    tune = given.pop("tune", None)
    if not isinstance(tune, dict):
        raise ConfigError(f"{path}: no [tune] table (see `fedpriv tune --help`)")
    sets = parse_overrides(overrides or [])
    space_raw = tune.get("space", {})
    if not isinstance(space_raw, dict):
        raise ConfigError("[tune] space: expected a table [tune.space]")
    space_raw = dict(space_raw)
    for key, value in sets.items():
        if key.startswith("tune.space."):
            space_raw[key[len("tune.space."):]] = value
        elif key.startswith("tune."):
            tune[key[len("tune."):]] = value
    tune["space"] = space_raw
    base_sets = {k: v for k, v in sets.items() if not k.startswith("tune.")}
    base = {**default_mapping(), **given, **base_sets}
    unknown = sorted(set(tune) - set(_TUNE_KEYS))
    if unknown:
        raise ConfigError(f"[tune]: unknown key(s) {unknown}; allowed: {list(_TUNE_KEYS)}")
    fixed = sorted(set(SET_BY_TUNING) & (set(given) - {"results-path"} | set(base_sets)))
    if fixed:
        raise ConfigError(f"{fixed}: set by the tuning for each candidate (the target is "
                          "[tune] epsilon/delta); remove them from the base")
    _check_base(set(given) | set(base_sets), base["algorithm"])
    space = _space(tune["space"], base["algorithm"])
    points = tuple(dict(zip(space, combo, strict=True))
                   for combo in itertools.product(*space.values()))
    method = _choice(tune, "method", "random-stopping", METHODS)
    search = _choice(tune, "search", "random", SEARCHES)
    epsilon = _number(tune, "epsilon", None, lambda x: x > 0 and math.isfinite(x), "> 0")
    delta = _number(tune, "delta", base.get("delta", 1e-6), lambda x: 0 < x < 1, "in (0, 1)")
    name = tune.get("name", Path(path).stem)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"[tune] name: {name!r} names the output folder: letters, digits, "
                          "'_', '-' and '.', not starting with '.'")
    maximize = tune.get("maximize", False)
    if not isinstance(maximize, bool):
        raise ConfigError(f"[tune] maximize: expected true or false, got {maximize!r}")
    repetitions, candidates = None, len(points)
    if method == "random-stopping":
        if "candidates" in tune:
            raise ConfigError("[tune] candidates: random stopping draws the number of "
                              "candidates (set expected-candidates)")
        if search != "random":
            raise ConfigError("[tune] search: random stopping always draws its candidates at "
                              "random from the space (\"grid\" is for compose-all)")
        dist = _choice(tune, "distribution", "logarithmic", DISTRIBUTIONS)
        mean = _number(tune, "expected-candidates", 10.0, lambda x: 1 < x <= 1e4,
                       "in (1, 10000]")
        eta = None
        if dist == "truncated-negative-binomial":
            eta = _number(tune, "eta", None, lambda x: 0 <= x < 1e6, "a number >= 0")
        elif "eta" in tune:
            raise ConfigError(f"[tune] eta: only distribution = \"truncated-negative-binomial\" "
                              f"takes a shape ({dist} has its own)")
        try:
            repetitions, candidates = Repetitions.named(dist, mean, eta), 0
        except InfeasiblePlanError as err:
            raise ConfigError(f"[tune] distribution: {err}") from None
    else:
        for key in ("distribution", "eta", "expected-candidates"):
            if key in tune:
                raise ConfigError(f"[tune] {key}: only random stopping draws the number of "
                                  "candidates")
        if search == "random":
            candidates = int(_number(tune, "candidates", None, lambda x: x >= 1 and x == int(x),
                                     "an integer >= 1"))
        elif "candidates" in tune:
            raise ConfigError("[tune] candidates: a grid runs every point once")
    secure = bool(base.get("secure-noise"))
    if base.get("aggregation", "central") != "central":
        raise ConfigError("aggregation: a private tuning runs central candidates only (a "
                          "distributed candidate's noise depends on which nodes answered)")
    if secure and method == "compose-all":
        raise ConfigError("method: compose-all composes the candidates with the PLD "
                          "accountant, which does not cover secure-noise's discrete Gaussian; "
                          "use random stopping (RDP)")
    if secure and "seed" in tune:
        raise ConfigError("[tune] seed: not allowed with secure-noise = true (K and the draws "
                          "then come from OS entropy: the selection's privacy needs them secret)")
    seed = None if secure else int(_number(tune, "seed", 0, lambda x: x >= 0 and x == int(x),
                                           "an integer >= 0"))
    spec = TuneSpec(
        name=name, epsilon=epsilon, delta=delta, method=method, repetitions=repetitions,
        candidates=candidates, search=search, score=str(tune.get("score", "validation_mse")),
        maximize=maximize, seed=seed, base=base, space=space, points=points)
    _check_points(spec)
    return spec


def _check_base(given: set[str], algorithm: str) -> None:
    """A key the file (or ``--set``) gives that the algorithm does not read is named as the
    base's, before any candidate is parsed."""
    try:
        read = select_keys(dict.fromkeys(given), algorithm)
    except ConfigError:
        return  # the unknown algorithm is reported when the points are parsed
    unread = sorted(set(given) - set(read))
    if unread:
        raise ConfigError(f"base: key(s) {unread} are not keys of {algorithm} (`fedpriv "
                          f"algorithms {algorithm}` lists its keys)")


def _space(raw: Any, algorithm: str) -> dict[str, tuple[Any, ...]]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("[tune.space]: give at least one run-config key to search over")
    own = {p.key: p for p in CORE.params}
    try:
        own.update(algorithm_params(algorithm))
        known = True
    except ConfigError:
        known = False  # the unknown algorithm is reported when the points are parsed
    space: dict[str, tuple[Any, ...]] = {}
    for key, spec in raw.items():
        if known and key not in own:
            raise ConfigError(f"[tune.space] {key}: not a key of {algorithm} (`fedpriv "
                              f"algorithms {algorithm}` lists its keys)")
        if key in SET_BY_TUNING:
            raise ConfigError(f"[tune.space] {key}: set by the tuning itself; it cannot be "
                              "searched")
        if key in NOT_SEARCHABLE:
            raise ConfigError(f"[tune.space] {key}: cannot vary between candidates (the "
                              "guarantee is about one population under one neighbouring "
                              "relation, with one kind of noise)")
        if isinstance(spec, list):
            values = tuple(spec)
        elif isinstance(spec, dict):
            values = _range(key, spec, own.get(key))
        else:
            raise ConfigError(f"[tune.space] {key}: expected a list of values or a range "
                              f"{{ low, high, num, log }}, got {spec!r}")
        if not values or len(set(map(repr, values))) != len(values):
            raise ConfigError(f"[tune.space] {key}: expected distinct values, got "
                              f"{list(values)}")
        space[key] = values
    return space


def _range(key: str, spec: dict[str, Any], param: Param | None) -> tuple[Any, ...]:
    unknown = sorted(set(spec) - set(_RANGE_KEYS))
    if unknown or not {"low", "high", "num"} <= set(spec):
        raise ConfigError(f"[tune.space] {key}: a range is {{ low, high, num, log }} (log "
                          f"optional), got {spec!r}")
    low, high, num, log = spec["low"], spec["high"], spec["num"], spec.get("log", False)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high))
    if not (numbers and isinstance(num, int) and not isinstance(num, bool) and num >= 2
            and isinstance(log, bool) and low < high and (not log or low > 0)):
        raise ConfigError(f"[tune.space] {key}: needs numbers low < high (low > 0 with log = "
                          f"true), an integer num >= 2 and log true or false, got {spec!r}")
    grid = np.geomspace(low, high, num) if log else np.linspace(low, high, num)
    if param is not None and param.kind is int:
        values = tuple(dict.fromkeys(int(round(x)) for x in grid))
        if len(values) < num:
            raise ConfigError(f"[tune.space] {key}: an integer key; {spec!r} rounds to only "
                              f"{list(values)} ({len(values)} of num = {num} points)")
        return values
    return tuple(float(f"{x:.6g}") for x in grid)


def _choice(tune: dict[str, Any], key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = tune.get(key, default)
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"[tune] {key}: {value!r} is not allowed; expected one of "
                          f"{list(allowed)}")
    return value


def _number(tune: dict[str, Any], key: str, default: float | None, ok: Callable[[float], bool],
            expected: str) -> float:
    value = tune.get(key, default)
    if value is None:
        raise ConfigError(f"[tune] {key}: required ({expected})")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ConfigError(f"[tune] {key}: {value!r} is not allowed; expected {expected}")
    return float(value)


def _check_points(spec: TuneSpec) -> None:
    """Every point parses as a strict run config of a size this machine runs
    (``fedpriv.cost``), is private, and releases the score."""
    from fedpriv.cost import check_size
    from fedpriv.evaluation import algorithm_for

    for point in spec.points:
        where = ", ".join(f"{k}={v!r}" for k, v in point.items())
        try:
            config = parse_config(spec.candidate_values(point, spec.epsilon), strict=True)
            check_size(config)
            cls = algorithm_for(config)
            cls.check_inputs(config)  # every value of a data file (cached)
        except ConfigError as err:
            raise ConfigError(f"candidate ({where}): {err}") from None
        # an evaluation hook of the family (``fedpriv.evaluation``), not of every algorithm
        if not hasattr(cls, "evaluation_bounds"):
            raise ConfigError(f"candidate ({where}): private-metrics: {config.algorithm} "
                              "provides no evaluation bounds")
        names: Mapping[str, float] = cls.evaluation_bounds(config)
        if spec.score not in names:
            raise ConfigError(f"[tune] score: {spec.score!r} is not a private metric of "
                              f"{config.algorithm}; it releases {sorted(names)}")


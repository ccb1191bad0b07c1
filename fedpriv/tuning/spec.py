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
    search = "random"                       # "random": draws from the space; "grid": every
    # candidates = 12                       #   point once (compose-all); draws of compose-all
    score = "validation_mse"                # the private metric candidates are compared on
    # maximize = false                      # lower is better (the default)
    seed = 0                                # draws K, the candidates and their noise seeds

    [tune.space]                            # run-config keys: lists, or ranges of num points
    learning-rate = [0.5, 1.0, 1.5]
    rounds = [3, 5]
    clip-norm = { low = 0.1, high = 1.0, num = 4, log = true }

The space is finite (a range is ``num`` points, evenly spaced, or log-spaced with ``log = true``;
integer keys are rounded), so each point's privacy plan can be calibrated before anything runs.
Every candidate runs with ``private-metrics = true`` and ``metrics-split = "validation"``: its
final step releases the noisy mean of its users' clipped validation losses, the score. The keys
the tuning sets itself (``epsilon``, ``delta``, ``private-metrics``, ``metrics-split``,
``noise-seed``, ``results-path``, ``checkpoint``, ``resume``) cannot be in the space.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedpriv.config import CORE, ConfigError, RunConfig, algorithm_params, default_mapping
from fedpriv.config_files import parse_overrides, read_config_file
from fedpriv.privacy.accounting import InfeasiblePlanError
from fedpriv.privacy.selection import DISTRIBUTIONS, Repetitions

METHODS = ("random-stopping", "compose-all")
SEARCHES = ("random", "grid")
SET_BY_TUNING = ("epsilon", "delta", "private-metrics", "metrics-split", "noise-seed",
                 "results-path", "checkpoint", "checkpoint-path", "resume")
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
    candidates: int  # compose-all: how many candidates run
    search: str
    score: str
    maximize: bool
    seed: int
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

    def draws(self) -> np.random.Generator:
        """The tuning's own generator (K, the candidates, their noise seeds)."""
        return np.random.default_rng([self.seed, _TUNE_STREAM])


def load_tune(path: str | Path, overrides: list[str] | None = None) -> TuneSpec:
    """Read and validate a tuning file (every point of the space parsed as a run config)."""
    given = read_config_file(path)
    tune = given.pop("tune", None)
    if not isinstance(tune, dict):
        raise ConfigError(f"{path}: no [tune] table (see `fedpriv tune --help`)")
    sets = parse_overrides(overrides or [])
    tune_sets = {k[len("tune."):]: v for k, v in sets.items() if k.startswith("tune.")}
    tune.update(tune_sets)
    base = {**default_mapping(), **given,
            **{k: v for k, v in sets.items() if not k.startswith("tune.")}}
    unknown = sorted(set(tune) - set(_TUNE_KEYS))
    if unknown:
        raise ConfigError(f"[tune]: unknown key(s) {unknown}; allowed: {list(_TUNE_KEYS)}")
    fixed = sorted(set(SET_BY_TUNING) & set(given) - {"results-path"})
    if fixed:
        raise ConfigError(f"{fixed}: set by the tuning for each candidate (the target is "
                          "[tune] epsilon/delta); remove them from the base")
    space = _space(tune.get("space"), base["algorithm"])
    points = tuple(dict(zip(space, combo, strict=True))
                   for combo in itertools.product(*space.values()))
    method = _choice(tune, "method", "random-stopping", METHODS)
    search = _choice(tune, "search", "random", SEARCHES)
    epsilon = _number(tune, "epsilon", None, lambda x: x > 0 and math.isfinite(x), "> 0")
    delta = _number(tune, "delta", base.get("delta", 1e-6), lambda x: 0 < x < 1, "in (0, 1)")
    repetitions, candidates = None, len(points)
    if method == "random-stopping":
        if "candidates" in tune:
            raise ConfigError("[tune] candidates: random stopping draws the number of "
                              "candidates (set expected-candidates)")
        dist = _choice(tune, "distribution", "logarithmic", DISTRIBUTIONS)
        mean = _number(tune, "expected-candidates", 10.0, lambda x: 1 < x <= 1e4,
                       "in (1, 10000]")
        try:
            repetitions = Repetitions.named(dist, mean, tune.get("eta"))
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
    spec = TuneSpec(
        name=str(tune.get("name", Path(path).stem)), epsilon=epsilon, delta=delta,
        method=method, repetitions=repetitions, candidates=candidates, search=search,
        score=str(tune.get("score", "validation_mse")),
        maximize=bool(tune.get("maximize", False)),
        seed=int(_number(tune, "seed", 0, lambda x: x >= 0 and x == int(x), "an integer >= 0")),
        base=base, space=space, points=points)
    _check_points(spec)
    return spec


def _space(raw: Any, algorithm: str) -> dict[str, tuple[Any, ...]]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("[tune.space]: give at least one run-config key to search over")
    own = {p.key: p for p in CORE.params}
    try:
        own.update(algorithm_params(algorithm))
    except ConfigError:
        pass  # the unknown algorithm is reported when the points are parsed
    space = {}
    for key, spec in raw.items():
        if key in SET_BY_TUNING:
            raise ConfigError(f"[tune.space] {key}: set by the tuning itself; it cannot be "
                              "searched")
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


def _range(key: str, spec: dict[str, Any], param: Any) -> tuple[Any, ...]:
    unknown = sorted(set(spec) - set(_RANGE_KEYS))
    if unknown or not {"low", "high", "num"} <= set(spec):
        raise ConfigError(f"[tune.space] {key}: a range is {{ low, high, num, log }} (log "
                          f"optional), got {spec!r}")
    low, high, num, log = spec["low"], spec["high"], spec["num"], bool(spec.get("log", False))
    if not (isinstance(num, int) and num >= 2 and low < high and (not log or low > 0)):
        raise ConfigError(f"[tune.space] {key}: needs low < high (low > 0 with log = true) and "
                          f"an integer num >= 2, got {spec!r}")
    grid = np.geomspace(low, high, num) if log else np.linspace(low, high, num)
    if param is not None and param.kind is int:
        return tuple(dict.fromkeys(int(round(x)) for x in grid))
    return tuple(float(f"{x:.6g}") for x in grid)


def _choice(tune: dict[str, Any], key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = tune.get(key, default)
    if value not in allowed:
        raise ConfigError(f"[tune] {key}: {value!r} is not allowed; expected one of "
                          f"{list(allowed)}")
    return value


def _number(tune: dict[str, Any], key: str, default: Any, ok: Any, expected: str) -> float:
    value = tune.get(key, default)
    if value is None:
        raise ConfigError(f"[tune] {key}: required ({expected})")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ConfigError(f"[tune] {key}: {value!r} is not allowed; expected {expected}")
    return float(value)


def _check_points(spec: TuneSpec) -> None:
    """Every point parses as a strict run config, is private, and releases the score."""
    from fedpriv.evaluation import algorithm_for

    for point in spec.points:
        where = ", ".join(f"{k}={v!r}" for k, v in point.items())
        try:
            config = RunConfig.from_mapping(spec.candidate_values(point, spec.epsilon),
                                            strict=True)
        except ConfigError as err:
            raise ConfigError(f"candidate ({where}): {err}") from None
        names = algorithm_for(config).evaluation_bounds(config)
        if spec.score not in names:
            raise ConfigError(f"[tune] score: {spec.score!r} is not a private metric of "
                              f"{config.algorithm}; it releases {sorted(names)}")


"""Flower's ``PrivacyAccountant`` protocol on fedpriv's PLD accounting, and noise calibration.

``PldAccountant`` is a drop-in for Flower 1.41's ``RdpAccountant`` (for instance as the
``accountant=`` of ``DifferentialPrivacyServerSideFixedClipping``): the same configuration,
events, results and JSON ledger, but the epsilon is computed with dp-accounting's privacy loss
distributions exactly as fedpriv accounts its own plans (``fedpriv.privacy.accounting``), which
is tight for Gaussian releases where RDP is loose (about 9% at 5 unsampled rounds calibrated to
epsilon = 1). ``calibrate_noise_multiplier`` gives the noise multiplier that makes ``rounds``
releases spend a target (epsilon, delta) under that accounting.
"""

from __future__ import annotations

import math
from typing import cast

from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    PrivacySpent,
    SamplingMethod,
)

from fedpriv.privacy.accounting import (
    EventKey,
    InfeasiblePlanError,
    PlannedRelease,
    calibrate_gaussian_plan,
    composed_event,
    epsilon_of,
    make_accountant,
)
from fedpriv.privacy.bounds import _gdp_delta, _gdp_epsilon

__all__ = ["PldAccountant", "calibrate_noise_multiplier"]

_STATE_SCHEMA_VERSION = 1
_ACCOUNTING_METHOD = "pld"
_KIND = "pld"
_RELATION = "add-remove"  # fedpriv's name for Flower's ADD_OR_REMOVE_ONE
_RELATIONS = ("add-remove", "replace-one")


class PldAccountant:
    """Track cumulative client-level privacy loss with privacy loss distributions (PLD).

    Implements Flower's ``PrivacyAccountant`` protocol. Every composed
    ``GaussianPrivacyEvent`` is the Gaussian mechanism with its noise multiplier, Poisson-sampled
    at ``sample_size / population_size`` under ``SamplingMethod.POISSON`` and unsampled under
    ``SamplingMethod.NO_AMPLIFICATION``. The accountant keeps Flower's event ledger; epsilon and
    delta are computed from it by ``fedpriv.privacy.accounting`` (a plan of the same releases
    gets exactly the same numbers there).

    ``SamplingMethod.WITHOUT_REPLACEMENT`` is refused: dp-accounting's PLD accountant has no
    analysis of sampling without replacement.
    """

    def __init__(self, config: PrivacyConfig) -> None:
        if not isinstance(config, PrivacyConfig):
            raise TypeError(f"config must be a flwr PrivacyConfig, got {type(config).__name__}")
        if config.sampling_method is SamplingMethod.WITHOUT_REPLACEMENT:
            raise ValueError(
                "PldAccountant cannot account sampling_method='without-replacement' (with "
                "neighboring_relation='replace-one'): dp-accounting's PLD accountant does not "
                "support SampledWithoutReplacementDpEvent. Sample clients with "
                "SamplingMethod.POISSON (and NeighboringRelation.ADD_OR_REMOVE_ONE), or use "
                "Flower's RdpAccountant for sampling without replacement.")
        if config.neighboring_relation is not NeighboringRelation.ADD_OR_REMOVE_ONE:
            raise ValueError("PldAccountant supports neighboring_relation='add-or-remove-one' "
                             f"only, got {config.neighboring_relation.value!r}.")
        self._config = config
        self._compositions: list[tuple[GaussianPrivacyEvent, int]] = []

    @property
    def config(self) -> PrivacyConfig:
        """Return the privacy configuration."""
        return self._config

    @property
    def num_releases(self) -> int:
        """Return the number of composed private releases."""
        return sum(count for _, count in self._compositions)

    def compose(self, event: GaussianPrivacyEvent, count: int = 1) -> None:
        """Compose one or more identical sampled Gaussian releases."""
        self._validate_event(event)
        _validate_count(count)
        self._compositions.append((event, count))

    def get_epsilon(self, delta: float) -> float:
        """Return cumulative epsilon at the supplied delta (``_spent``)."""
        _validate_delta(delta)
        return _spent(self._counts(), float(delta))

    def get_delta(self, epsilon: float) -> float:
        """Return cumulative delta at the supplied epsilon."""
        _validate_epsilon(epsilon)
        counts = self._counts()
        if not counts:
            return 0.0
        if _tiny(counts):
            return _gdp_delta(_unsampled_mu(counts), float(epsilon))
        backend = make_accountant(_KIND, _RELATION, sampled=any(q < 1.0 for _, q in counts))
        backend.compose(composed_event(counts, _RELATION))
        return float(backend.get_delta(float(epsilon)))

    def get_privacy_spent(self, delta: float | None = None) -> PrivacySpent:
        """Return cumulative privacy expenditure at delta (default: the target delta)."""
        target_delta = self._config.target_delta if delta is None else delta
        return PrivacySpent(
            epsilon=self.get_epsilon(target_delta),
            delta=target_delta,
            num_releases=self.num_releases,
            accounting_method="gdp" if _tiny(self._counts()) else _ACCOUNTING_METHOD,
        )

    def would_exceed(
        self,
        event: GaussianPrivacyEvent,
        max_epsilon: float | None = None,
        count: int = 1,
    ) -> bool:
        """Return whether composing an event would exceed an epsilon limit.

        This method does not mutate committed accountant state.
        """
        self._validate_event(event)
        _validate_count(count)
        limit = self._config.max_epsilon if max_epsilon is None else max_epsilon
        if limit is None:
            raise ValueError(
                "max_epsilon must be supplied either in PrivacyConfig or to would_exceed().")
        _validate_positive_epsilon("max_epsilon", limit)
        counts = self._counts()
        key = self._key(event)
        counts[key] = counts.get(key, 0) + count
        spent = _spent(counts, self._config.target_delta)
        return bool(spent > limit)

    def state_dict(self) -> dict[str, object]:
        """Return JSON-serializable accountant state (configuration and event ledger)."""
        return {
            "schema_version": _STATE_SCHEMA_VERSION,
            "backend": _ACCOUNTING_METHOD,
            "config": {
                "target_delta": self._config.target_delta,
                "population_size": self._config.population_size,
                "neighboring_relation": self._config.neighboring_relation.value,
                "sampling_method": self._config.sampling_method.value,
                "max_epsilon": self._config.max_epsilon,
            },
            "compositions": [
                {
                    "event": {
                        "noise_multiplier": event.noise_multiplier,
                        "sample_size": event.sample_size,
                        "population_size": event.population_size,
                    },
                    "count": count,
                }
                for event, count in self._compositions
            ],
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore state produced by :meth:`state_dict`.

        The state must come from a PLD accountant with the same privacy configuration; the
        accounting is rebuilt from its event ledger. Nothing changes when it is refused.
        """
        if not isinstance(state, dict):
            raise ValueError("Accountant state must be a dictionary.")
        schema_version = state.get("schema_version")
        if schema_version != _STATE_SCHEMA_VERSION:
            raise ValueError(
                f"Unsupported accountant state schema version: {schema_version!r}.")
        backend = state.get("backend")
        if backend != _ACCOUNTING_METHOD:
            raise ValueError(f"Accountant state was produced by a different backend "
                             f"({backend!r}), not {_ACCOUNTING_METHOD!r}.")
        if _parse_config(state.get("config")) != self._config:
            raise ValueError("Accountant state privacy configuration does not match the "
                             "current configuration.")
        compositions = _parse_compositions(state.get("compositions"))
        for event, _ in compositions:
            self._validate_event(event)
        self._compositions = compositions

    def _key(self, event: GaussianPrivacyEvent) -> EventKey:
        """The event as fedpriv accounts it: (noise multiplier, Poisson sampling rate)."""
        if self._config.sampling_method is SamplingMethod.POISSON:
            return float(event.noise_multiplier), event.sample_size / event.population_size
        return float(event.noise_multiplier), 1.0

    def _counts(self) -> dict[EventKey, int]:
        counts: dict[EventKey, int] = {}
        for event, count in self._compositions:
            key = self._key(event)
            counts[key] = counts.get(key, 0) + count
        return counts

    def _validate_event(self, event: GaussianPrivacyEvent) -> None:
        if not isinstance(event, GaussianPrivacyEvent):
            raise TypeError(
                f"event must be a flwr GaussianPrivacyEvent, got {type(event).__name__}")
        if event.population_size != self._config.population_size:
            raise ValueError(
                "Privacy event population_size does not match PrivacyConfig: "
                f"{event.population_size} != {self._config.population_size}.")


TINY_MULTIPLIER = 0.05
"""Below this noise multiplier (fedpriv's calibration floor) dp-accounting's privacy-loss
distribution would need a grid of gigabytes (tens at 1e-3): such events are accounted in
closed form instead (``_spent``)."""


def _tiny(counts: dict[EventKey, int]) -> bool:
    return any(z < TINY_MULTIPLIER for z, _ in counts)


def _unsampled_mu(counts: dict[EventKey, int]) -> float:
    """The mu of the composition as mu-GDP, sampling ignored: each Gaussian release of
    multiplier z is exactly (1/z)-GDP, and mu-GDP composes as the root of the sum of squares."""
    return math.sqrt(sum(count / z**2 for (z, _), count in counts.items()))


def _spent(counts: dict[EventKey, int], delta: float) -> float:
    """The epsilon of the composition at ``delta``: fedpriv's PLD accounting, or, when an
    event's multiplier is below ``TINY_MULTIPLIER`` (a debug run with the noise nearly off),
    the exact epsilon of the unsampled composition as mu-GDP (Dong, Roth & Su), an upper bound
    when events were sampled (sampling only lowers it), ``inf`` beyond 1e4."""
    if _tiny(counts):
        return _gdp_epsilon(_unsampled_mu(counts), delta)
    return epsilon_of(counts, delta, _KIND, _RELATION)


def calibrate_noise_multiplier(
    epsilon: float,
    delta: float,
    rounds: int,
    sampling_rate: float = 1.0,
    *,
    relation: str = "add-remove",
) -> float:
    """The noise multiplier ``z`` (noise std / L2 sensitivity) such that ``rounds`` Gaussian
    releases, Poisson-sampled at ``sampling_rate`` when it is below 1, spend at most
    (``epsilon``, ``delta``) under fedpriv's PLD accounting (and as close to it as the
    accountant confirms). ``relation``: "add-remove" (Flower's ADD_OR_REMOVE_ONE) or
    "replace-one", the neighbouring relation the sensitivity is stated for.

    Composing ``rounds`` events with this multiplier in a ``PldAccountant`` (POISSON at
    ``sample_size / population_size = sampling_rate``, or NO_AMPLIFICATION when it is 1)
    reports at most ``epsilon`` at ``delta``. Raises ``ValueError`` naming the argument to
    change for a bad or unreachable target.
    """
    _validate_positive_epsilon("epsilon", epsilon)
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not (
            math.isfinite(delta) and 0 < delta < 1):
        raise ValueError(f"delta must be finite and strictly between 0 and 1, got {delta!r}.")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}.")
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, float)) or not (
            math.isfinite(sampling_rate) and 0 < sampling_rate <= 1):
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}.")
    if relation not in _RELATIONS:
        raise ValueError(f"relation must be one of {_RELATIONS}, got {relation!r}.")
    release = PlannedRelease("round", 1.0, rounds, float(sampling_rate))
    try:
        multipliers = calibrate_gaussian_plan([release], float(epsilon), float(delta), _KIND,
                                              relation)
    except InfeasiblePlanError as err:
        advice = ("the target is too loose for so few releases: lower epsilon, or raise rounds"
                  if "multipliers below" in str(err) else
                  "the target is too tight for any noise level: raise epsilon (or delta)")
        raise InfeasiblePlanError(
            f"cannot calibrate epsilon={epsilon} at delta={delta} over rounds={rounds} "
            f"(sampling_rate={sampling_rate}): {err}; {advice}.") from err
    return float(multipliers[0])


def _parse_config(value: object) -> PrivacyConfig:
    config = _require_dict(value, "config")
    try:
        max_epsilon = config["max_epsilon"]
        return PrivacyConfig(
            target_delta=_require_float(config["target_delta"], "target_delta"),
            population_size=_require_int(config["population_size"], "population_size"),
            neighboring_relation=NeighboringRelation(
                _require_str(config["neighboring_relation"], "neighboring_relation")),
            sampling_method=SamplingMethod(
                _require_str(config["sampling_method"], "sampling_method")),
            max_epsilon=(None if max_epsilon is None
                         else _require_float(max_epsilon, "max_epsilon")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError("Invalid privacy configuration in accountant state.") from exc


def _parse_compositions(value: object) -> list[tuple[GaussianPrivacyEvent, int]]:
    if not isinstance(value, list):
        raise ValueError("Accountant state compositions must be a list.")
    compositions: list[tuple[GaussianPrivacyEvent, int]] = []
    try:
        for item in value:
            composition = _require_dict(item, "composition")
            event = _require_dict(composition["event"], "event")
            count = _require_int(composition["count"], "count")
            _validate_count(count)
            compositions.append((GaussianPrivacyEvent(
                noise_multiplier=_require_float(event["noise_multiplier"], "noise_multiplier"),
                sample_size=_require_int(event["sample_size"], "sample_size"),
                population_size=_require_int(event["population_size"], "population_size"),
            ), count))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError("Invalid composition in accountant state.") from exc
    return compositions


def _require_dict(value: object, name: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise ValueError(f"Accountant state {name} must be a dictionary.")
    return cast(dict[str, object], value)


def _require_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"Accountant state {name} must be an integer.")
    return value


def _require_float(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (float, int)):
        raise ValueError(f"Accountant state {name} must be numeric.")
    return float(value)


def _require_str(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"Accountant state {name} must be a string.")
    return value


def _validate_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise ValueError("count must be a positive integer.")


def _validate_delta(delta: float) -> None:
    if isinstance(delta, bool) or not math.isfinite(delta) or not 0 < delta < 1:
        raise ValueError("delta must be finite and strictly between 0 and 1.")


def _validate_epsilon(epsilon: float) -> None:
    if isinstance(epsilon, bool) or not math.isfinite(epsilon) or epsilon < 0:
        raise ValueError("epsilon must be non-negative and finite.")


def _validate_positive_epsilon(name: str, epsilon: float) -> None:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not (
            math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"{name} must be positive and finite, got {epsilon!r}.")

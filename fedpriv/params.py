"""Run-config parameters, declared by whoever uses them.

A ``Param`` is one kebab-case run-config key with its type, default, allowed range and help. The
core config (``fedpriv.config``) declares what every run has; an algorithm, or a family of
algorithms, declares its own keys next to its code as ``ParamGroup``s and lists them in its
``components`` (see ``fedpriv.algorithms.base.Algorithm``). Everything that lists or checks keys
reads these declarations: validation, ``fedpriv algorithms``, the documented key tables, checkpoint
compatibility and the Flower app's ``[tool.flwr.app.config]``.

Typed keys: a component's keys are the fields of a frozen dataclass (a ``RunConfig`` subclass in
``fedpriv.config``), each declared by ``key(PARAM)``, so a type checker follows every key an
algorithm reads; ``component_params`` reads the declarations back.

A key shared by several components (``clip-norm``, say) is one ``Param`` object imported where it
is used, so it has one default and one meaning; ``merge_params`` refuses two different
declarations of the same key. This module sits at the bottom of the package: it imports nothing
from fedpriv.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any


class ConfigError(ValueError):
    """A run-config value is invalid; the message names the key and what is allowed."""


@dataclass(frozen=True)
class Param:
    """One run-config key.

    ``check`` is a predicate on the coerced value and ``allowed`` says in words what it accepts
    (both appear in the error of a bad value). ``resumable`` marks an operational key that may
    change when an interrupted run is resumed (where results go, how the run is operated), never
    one that changes what the run computes. ``public = False`` keeps a key out of the release
    of a run (``fedpriv.outputs``): seeds, paths, anything that is not for publication.
    ``fallback`` marks a key whose good default depends on the algorithm (``rounds``, say):
    ``default`` is then a placeholder outside the key's working range that each algorithm
    replaces by its own value, and ``fallback`` is that value for algorithms that name none.
    """

    key: str
    kind: type
    default: Any
    help: str
    check: Callable[[Any], bool] | None = None
    allowed: str = ""
    resumable: bool = False
    public: bool = True
    fallback: Any = None

    @property
    def per_algorithm(self) -> bool:
        """Whether the default depends on the algorithm: ``default`` is then a placeholder
        ("the algorithm's own"), resolved to the algorithm's ``defaults`` entry, or to
        ``fallback`` when it names none (``fedpriv.algorithms.base.Algorithm.default_of``)."""
        return self.fallback is not None

    def __post_init__(self) -> None:
        if self.kind not in (bool, int, float, str):
            raise TypeError(f"{self.key}: kind must be bool, int, float or str")
        if self.key != self.key.lower() or "_" in self.key or not self.key:
            raise ValueError(f"{self.key!r}: keys are kebab-case")

    @property
    def attr(self) -> str:
        """The attribute name on a ``RunConfig`` (the key in snake_case)."""
        return self.key.replace("-", "_")

    def parse(self, value: Any) -> Any:
        """The value coerced to ``kind`` and checked; ``ConfigError`` naming the key if not."""
        coerced = _coerce(self, value)
        if self.check is not None and not self.check(coerced):
            raise ConfigError(f"{self.key}: {coerced!r} is not allowed; expected {self.allowed}")
        return coerced


@dataclass(frozen=True)
class ParamGroup:
    """The keys one component declares: ``name`` is how listings and errors refer to them;
    ``check`` takes relations between keys (``rank <= dim``, say) and raises ``ConfigError``
    naming the key."""

    name: str
    params: tuple[Param, ...]
    check: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        merge_params([self])  # no key twice within a group


@dataclass(frozen=True)
class Rule:
    """An algorithm's default computed from the run's core keys (``num-users``, ``epsilon``,
    ...: a mapping by attribute name), where one number cannot suit every problem size;
    ``text`` says the rule in listings."""

    compute: Callable[[Mapping[str, Any]], Any]
    text: str

    def __call__(self, core: Mapping[str, Any]) -> Any:
        return self.compute(core)


PARAM = "fedpriv-param"


def key(param: Param) -> Any:
    """A typed config field declared by ``param``: ``dim: int = key(DIM)``. The field's name
    must be the key in snake_case and its annotation the key's kind (``component_params``
    checks both)."""
    return field(default=param.default, metadata={PARAM: param})


def component_params(cls: type) -> tuple[Param, ...]:
    """The keys the dataclass ``cls`` itself declares (not those of its bases), in order."""
    own = cls.__dict__.get("__annotations__", {})
    declared: list[Param] = []
    by_name: dict[str, Field[Any]] = {f.name: f for f in fields(cls)}
    for name, annotation in own.items():
        spec = by_name.get(name)
        if spec is None:
            continue  # a ClassVar
        param = spec.metadata.get(PARAM)
        if not isinstance(param, Param):
            raise TypeError(f"{cls.__qualname__}.{name}: declare it with key(Param(...))")
        kind = annotation if isinstance(annotation, str) else annotation.__name__
        if name != param.attr or kind != param.kind.__name__:
            raise TypeError(f"{cls.__qualname__}.{name}: {param.key} is declared as "
                            f"'{param.attr}: {param.kind.__name__}', not '{name}: {kind}'")
        declared.append(param)
    return tuple(declared)


def merge_params(groups: Iterable[ParamGroup]) -> dict[str, Param]:
    """Every key of ``groups``, in order; a key declared twice must be the same declaration."""
    merged: dict[str, Param] = {}
    for group in groups:
        for param in group.params:
            seen = merged.get(param.key)
            if seen is not None and seen != param:
                raise ValueError(f"{param.key}: declared twice with different meanings "
                                 f"({seen!r} and {param!r}); share one Param")
            merged[param.key] = param
    return merged


def _coerce(param: Param, value: Any) -> Any:
    key, kind = param.key, param.kind
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if kind is str:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ConfigError(f"{key}: expected {param.allowed or 'a string'}, got {value!r}")
        return str(value)
    if kind is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and float(value).is_integer())
        ):
            raise ConfigError(f"{key}: expected {param.allowed or 'an integer'}, got {value!r}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected {param.allowed or 'a number'}, got {value!r}")
    return float(value)


# ----- checks used by many declarations ---------------------------------------------------------
def positive(x: Any) -> bool:
    return bool(x > 0)


def non_negative(x: Any) -> bool:
    return bool(x >= 0)


def unit_open(x: Any) -> bool:
    return bool(0 < x < 1)


def finite(x: Any) -> bool:
    return math.isfinite(x)


def one_of(choices: Iterable[str]) -> tuple[Callable[[Any], bool], str]:
    """A ``(check, allowed)`` pair for a string key with fixed choices."""
    options = tuple(choices)
    return (lambda x: x in options), f"one of {', '.join(options)}"

"""Algorithm registry: an algorithm is registered by name and selected by ``algorithm`` in the
run-config.

The built-in algorithms are listed in ``fedpriv.algorithms.catalogue``; third-party packages add
their own through the ``fedpriv.algorithms`` entry point group (``name =
"package.module:AlgorithmClass"``; see docs/tutorials/own-algorithm.md). Algorithm modules do
not import this module, so the registry can import them without a circle. ``register`` adds a
class programmatically (tests, notebooks).
"""

from __future__ import annotations

import difflib
import warnings
from importlib.metadata import entry_points
from typing import Any, TypeVar

from fedpriv.algorithms.base import Algorithm
from fedpriv.algorithms.deep.without_torch import NeedsTorch, load

ENTRY_POINT_GROUP = "fedpriv.algorithms"
A = TypeVar("A", bound=type[Algorithm[Any]])

_REGISTRY: dict[str, type[Algorithm[Any]]] = {}
_FAILED: dict[str, str] = {}  # entry points that could not be loaded: name -> why
_loaded = {"builtins": False, "entry_points": False}


def register(cls: A) -> A:
    """Register ``cls`` under ``cls.name`` (usable as a class decorator)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls!r} needs a non-empty class attribute 'name'")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"algorithm {name!r} is already registered by {existing!r}")
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"{cls!r} is not a fedpriv Algorithm (subclass "
                        "fedpriv.algorithms.base.Algorithm)")
    params = cls.declared_params()  # a key declared twice with different meanings fails here
    for key, param in params.items():
        if param.resumable:
            raise ValueError(f"algorithm {name!r}: {key} is marked resumable, but only the core "
                             "(operational) keys may change on resume")
        for other in _REGISTRY.values():
            theirs = other.declared_params().get(key)
            if theirs is not None and theirs != param:
                raise ValueError(
                    f"algorithm {name!r} declares {key} differently from {other.name!r}; a key "
                    "keeps one meaning and default everywhere (import the shared Param, e.g. "
                    "from fedpriv.algorithms.shared_params, or choose another name)")
    _REGISTRY[name] = cls
    return cls


def _load_builtins() -> None:
    if not _loaded["builtins"]:
        from fedpriv.algorithms.catalogue import BUILTIN

        for cls in BUILTIN:
            register(cls)
        _loaded["builtins"] = True


def _load_entry_points() -> None:
    if not _loaded["entry_points"]:
        _loaded["entry_points"] = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in _REGISTRY:
                continue
            try:  # one broken plug-in must not stop the runs of every other algorithm
                cls = ep.load()
                if getattr(cls, "name", None) != ep.name:
                    raise ValueError(f"it loads an algorithm named "
                                     f"{getattr(cls, 'name', None)!r}; the names must match")
                register(cls)
            except Exception as err:  # noqa: BLE001 -- reported, and raised when it is asked for
                _FAILED[ep.name] = f"plug-in {ep.name!r} ({ep.value}) failed to load: {err}"
                warnings.warn(_FAILED[ep.name], stacklevel=2)


def available() -> list[str]:
    _load_builtins()
    _load_entry_points()
    return sorted(_REGISTRY)


def declared(name: str) -> type[Algorithm[Any]]:
    """The algorithm ``name`` as registered: its name, summary and keys. A deep algorithm is its
    declaration here (``without_torch``), without loading torch: what listings and key checks
    read (a Flower node checks the run-config, which holds every algorithm's keys, on every
    message)."""
    _load_builtins()
    if name not in _REGISTRY:
        _load_entry_points()
    if name in _FAILED:
        raise KeyError(_FAILED[name])
    if name not in _REGISTRY:
        raise KeyError(unknown_algorithm(name))
    return _REGISTRY[name]


def get_algorithm(name: str) -> type[Algorithm[Any]]:
    """The algorithm ``name``, ready to run (a deep one's implementation loads torch)."""
    cls = declared(name)
    if issubclass(cls, NeedsTorch):  # a declaration: the implementation loads now
        _REGISTRY[name] = cls = load(cls)
    return cls


def unknown_algorithm(name: str) -> str:
    """The message for an algorithm name nobody registered: the closest registered name (a
    likely typo) first, then every registered one."""
    known = sorted({*_REGISTRY, *_FAILED})
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown algorithm {name!r}{hint} (registered: {', '.join(sorted(_REGISTRY))})"

"""Algorithm registry: an algorithm is registered by name and selected by ``algorithm`` in the
run-config.

The built-in algorithms are listed in ``fedpriv.algorithms.catalogue``; third-party packages add
their own through the ``fedpriv.algorithms`` entry point group (``name =
"package.module:AlgorithmClass"``; see the README, "Writing an algorithm"). Algorithm modules do
not import this module, so the registry can import them without a circle. ``register`` adds a
class programmatically (tests, notebooks).
"""

from __future__ import annotations

from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "fedpriv.algorithms"

_REGISTRY: dict[str, type] = {}
_loaded = {"builtins": False, "entry_points": False}


def register(cls: type) -> type:
    """Register ``cls`` under ``cls.name`` (usable as a class decorator)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls!r} needs a non-empty class attribute 'name'")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"algorithm {name!r} is already registered by {existing!r}")
    declared = getattr(cls, "declared_params", None)
    if declared is None:
        raise TypeError(f"{cls!r} is not a fedpriv Algorithm (no declared_params)")
    declared()  # a key declared twice with different meanings fails here, at registration
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
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name not in _REGISTRY:
                cls = ep.load()
                if getattr(cls, "name", None) != ep.name:
                    raise ValueError(f"entry point {ep.name!r} ({ep.value}) loads an algorithm "
                                     f"named {getattr(cls, 'name', None)!r}; the names must match")
                register(cls)
        _loaded["entry_points"] = True


def available() -> list[str]:
    _load_builtins()
    _load_entry_points()
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> type:
    _load_builtins()
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        raise KeyError(f"unknown algorithm {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]

"""Algorithm registry: an algorithm is registered by name and selected by ``algorithm`` in the
run-config. Third-party packages add their own through the ``fedpriv.algorithms`` entry point
group (``name = "package.module:AlgorithmClass"``); see the README, "Writing an algorithm"."""

from __future__ import annotations

from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "fedpriv.algorithms"

_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: register an algorithm under ``cls.name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls!r} needs a non-empty class attribute 'name'")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"algorithm {name!r} is already registered by {existing!r}")
    _REGISTRY[name] = cls
    return cls


def _load_builtins() -> None:
    # the built-in algorithms register themselves on import
    import fedpriv.algorithms.baselines  # noqa: F401
    import fedpriv.algorithms.exp_mech  # noqa: F401
    import fedpriv.algorithms.meta  # noqa: F401
    import fedpriv.algorithms.priv_altmin  # noqa: F401
    import fedpriv.algorithms.private_fedrep  # noqa: F401


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            register(ep.load())


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

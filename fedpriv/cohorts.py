"""Moved: ``fedpriv.cohorts`` was split by job (typed keys, issue 34). Importing a name from here
still works, with a ``DeprecationWarning`` naming its new home."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

MOVED = {
    "partition_users": "fedpriv.algorithms.base",
    "cohort_data": "fedpriv.data.cache",
    "block_users": "fedpriv.data.cache",
    "BLOCK_USERS_ENV": "fedpriv.data.cache",
    "CACHE_MB_ENV": "fedpriv.data.cache",
    "DEFAULT_CACHE_MB": "fedpriv.data.cache",
    "BlockCache": "fedpriv.data.cache",
    "node_step": "fedpriv.nodes",
    "add_contributions": "fedpriv.nodes",
    "auto_num_nodes": "fedpriv.nodes",
}


def __getattr__(name: str) -> Any:
    if name == "CACHE":
        raise AttributeError("fedpriv.cohorts.CACHE moved: fedpriv.data.cache.block_cache() "
                             "returns the process's cache (made on first use)")
    home = MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'fedpriv.cohorts' has no attribute {name!r}")
    warnings.warn(f"fedpriv.cohorts.{name} moved to {home}.{name}", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(home), name)

"""A sweep's folder as a cache of its runs: a finished run with exactly the run's config is
reused; one of an earlier config under the same name is moved aside (never overwritten)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedpriv.configure import parse_config


def reusable(path: Path, values: dict[str, Any]) -> dict[str, Any] | None:
    """A finished run from an earlier invocation with exactly this config, if any."""
    if not path.is_file():
        return None
    try:
        results: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    wanted = parse_config(values).to_mapping()
    stored = dict(results.get("config", {}))
    wanted.pop("results-path"), stored.pop("results-path", None)
    return results if stored == wanted else None


def set_aside(path: Path) -> bool:
    """Move an earlier config's run at ``path`` (its files) to ``runs/replaced/``, under the
    first free numbered name; whether there was one."""
    from fedpriv.outputs import run_files

    if not path.is_file():
        return False
    folder = path.parent / "replaced"
    folder.mkdir(exist_ok=True)
    n = 1
    while (folder / f"{path.stem}-{n}.json").exists():
        n += 1
    for old, new in zip(run_files(path), run_files(folder / f"{path.stem}-{n}.json"),
                        strict=True):
        if old.exists():
            os.replace(old, new)
    return True

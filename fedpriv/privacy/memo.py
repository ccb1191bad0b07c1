"""The accountant's answers, remembered: a privacy plan's calibration and a composition's epsilon
are pure functions of their inputs, so each is computed by dp-accounting once and then read back.

A run computes the same plan in several processes (``fedpriv run`` checks it before Flower
starts, the ServerApp calibrates it again, a sweep's runs over seeds share it), and a sampled
plan's calibration builds dozens of privacy-loss distributions (seconds each). Answers are kept
in this process's memory and, across processes, as one small JSON file per answer in a folder:
``FEDPRIV_ACCOUNTING_CACHE`` (``off`` keeps them in memory only), by default
``$XDG_CACHE_HOME/fedpriv/accounting`` (``~/.cache/fedpriv/accounting``).

An answer is found only under the exact inputs (floats by their exact ``repr``), the installed
dp-accounting version and the source of fedpriv's accounting modules: changing either computes
afresh. A file that cannot be read or does not hold an answer of the expected shape is ignored
and recomputed; a folder that cannot be written is skipped. Errors (an infeasible plan) are
never remembered. The files hold only public numbers (noise multipliers, epsilons).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

MEMO_ENV = "FEDPRIV_ACCOUNTING_CACHE"
OFF = ("off", "0", "false", "no", "")
_SOURCES = ("accounting.py", "bounds.py", "memo.py")

Answer = TypeVar("Answer", float, list[float])
_memory: dict[str, float | list[float]] = {}


@lru_cache(maxsize=1)
def _identity() -> str:
    """What the answers depend on besides their inputs: dp-accounting's version and the source
    of the modules that compute them."""
    from importlib.metadata import version

    return source_digest(version("dp-accounting"), Path(__file__).parent)


def source_digest(library_version: str, here: Path) -> str:
    """A digest of ``library_version`` and the accounting modules' source in ``here``."""
    digest = hashlib.sha256(library_version.encode())
    for name in _SOURCES:
        digest.update(name.encode() + b"\0" + (here / name).read_bytes())
    return digest.hexdigest()


def folder() -> Path | None:
    """Where answers are kept across processes; None when ``FEDPRIV_ACCOUNTING_CACHE`` is off."""
    named = os.environ.get(MEMO_ENV)
    if named is not None:
        return None if named.strip().lower() in OFF else Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "fedpriv", "accounting")


def _valid(value: object, like: type) -> bool:
    if like is float:
        return isinstance(value, float) and not math.isnan(value)
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, float) and math.isfinite(v) and v > 0 for v in value)


def remembered(kind: str, inputs: object, compute: Callable[[], Answer]) -> Answer:
    """``compute()``'s answer for ``inputs`` (a value with an exact ``repr``): from memory, from
    the folder, or computed and kept in both. ``kind`` names the question (``calibrate``,
    ``epsilon``)."""
    key = hashlib.sha256(f"{kind}\n{inputs!r}\n{_identity()}".encode()).hexdigest()
    known = _memory.get(key)
    if known is not None:
        return list(known) if isinstance(known, list) else known  # type: ignore[return-value]
    where = folder()
    path = where / key[:2] / f"{key}.json" if where is not None else None
    if path is not None:
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = None
        if isinstance(stored, dict) and stored.get("kind") == kind and _valid(
                stored.get("answer"), float if kind == "epsilon" else list):
            _memory[key] = stored["answer"]
            return remembered(kind, inputs, compute)
    answer = compute()
    _memory[key] = list(answer) if isinstance(answer, list) else answer
    if path is not None:
        _store(path, {"kind": kind, "inputs": repr(inputs), "answer": answer})
    return answer


def _store(path: Path, record: dict[str, object]) -> None:
    """Write ``record`` to ``path`` whole or not at all (a temporary file renamed into place:
    processes that compute the same answer at once each write a complete file)."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp",
                                         delete=False) as handle:
            tmp = handle.name
            json.dump(record, handle)
        os.replace(tmp, path)
    except OSError:  # a read-only or full folder: the answer stays in memory only
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def forget() -> None:
    """Drop the answers held in this process's memory (the folder is left as it is)."""
    _memory.clear()

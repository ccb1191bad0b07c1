"""The accountant's answers, remembered: a privacy plan's calibration is a pure function of its
inputs, so dp-accounting computes it once and later processes read it back and confirm it (a
private tuning's budget too: ``fedpriv.tuning.budget``, confirmed there by its own check).

A run calibrates the same plan in several processes (``fedpriv run`` checks it before Flower
starts, the ServerApp calibrates it again, a sweep's runs over seeds share it), and a
Poisson-sampled plan's calibration builds dozens of privacy-loss distributions (seconds each).
Calibrations are kept in this process's memory and, across processes, as one small JSON file
each in a folder: ``FEDPRIV_ACCOUNTING_CACHE`` (``off`` keeps them in memory only), by default
``$XDG_CACHE_HOME/fedpriv/accounting`` (``~/.cache/fedpriv/accounting``). A composition's
epsilon (what the ledger reports) is remembered in memory only: every process computes the
epsilons it reports.

A file is used only if it answers exactly these inputs (floats by their exact ``repr``) under
the installed dp-accounting, NumPy and SciPy versions and the same source of fedpriv's
accounting modules, and if its answer passes the caller's check: a calibration read from a
file is confirmed by the accountant in this process (one composition of the whole plan, which
must spend the target and no more), so a damaged or forged file can cost time, never privacy.
A file that fails is recomputed and rewritten; a folder that cannot be written is skipped;
errors (an infeasible plan) are never remembered. The files hold only public numbers.
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
_MEMORY_LIMIT = 65536  # answers held in memory (the oldest are dropped first)


@lru_cache(maxsize=1)
def _identity() -> str:
    """What the answers depend on besides their inputs: dp-accounting's, NumPy's and SciPy's
    versions and the source of the modules that compute them."""
    from importlib.metadata import version

    versions = ";".join(version(name) for name in ("dp-accounting", "numpy", "scipy"))
    return source_digest(versions, Path(__file__).parent)


def source_digest(library_versions: str, here: Path) -> str:
    """A digest of ``library_versions`` and the accounting modules' source in ``here``."""
    digest = hashlib.sha256(library_versions.encode())
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


def remembered(kind: str, inputs: object, compute: Callable[[], Answer],
               check: Callable[[Answer], bool]) -> Answer:
    """``compute()``'s answer for ``inputs`` (plain Python values with an exact ``repr``): from
    this process's memory, else from the folder if ``check`` accepts it (a file is never used
    unchecked), else computed and kept. ``kind`` names the question."""
    key = hashlib.sha256(f"{kind}\n{inputs!r}\n{_identity()}".encode()).hexdigest()
    known = _memory.get(key)
    if known is not None:
        return list(known) if isinstance(known, list) else known  # type: ignore[return-value]
    where = folder()
    path = where / key[:2] / f"{key}.json" if where is not None else None
    if path is not None:
        stored = _read(path, kind, repr(inputs))
        if stored is not None and check(stored):  # type: ignore[arg-type]
            _keep(key, stored)
            return list(stored) if isinstance(stored, list) else stored  # type: ignore[return-value]
    answer = compute()
    _keep(key, answer)
    if path is not None:
        _store(path, {"kind": kind, "inputs": repr(inputs), "answer": answer})
    return answer


def _keep(key: str, answer: float | list[float]) -> None:
    if len(_memory) >= _MEMORY_LIMIT:
        _memory.pop(next(iter(_memory)))
    _memory[key] = list(answer) if isinstance(answer, list) else answer


def _read(path: Path, kind: str, inputs: str) -> float | list[float] | None:
    """The answer a file holds for exactly ``kind`` and ``inputs``, if it has the right shape."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("kind") != kind or stored.get(
            "inputs") != inputs:
        return None
    answer = stored.get("answer")
    if isinstance(answer, float) and not math.isnan(answer):
        return answer
    if isinstance(answer, list) and answer and all(
            isinstance(v, float) and math.isfinite(v) and v > 0 for v in answer):
        return answer
    return None


def _store(path: Path, record: dict[str, object]) -> None:
    """Write ``record`` to ``path`` whole or not at all (a temporary file renamed into place:
    processes that compute the same answer at once each write a complete file)."""
    tmp: str | None = None
    try:
        text = json.dumps(record)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp",
                                         delete=False) as handle:
            tmp = handle.name
            handle.write(text)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):  # unwritable or unencodable: memory only
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def forget() -> None:
    """Drop the answers held in this process's memory (the folder is left as it is)."""
    _memory.clear()

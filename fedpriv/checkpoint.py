"""Server checkpoints: the whole server state after every step, written atomically.

A checkpoint holds the run's config, how many steps are done, the algorithm's server state
(model, and any secret noise state such as DP-FTMRL's tree), the accountant with its ledger, the
counters of the noise stream and the per-step reports. It is written *before* the step's result
leaves the server (progress line, next broadcast, results file), so a release is either in the
checkpoint or was never seen: a resumed run counts each release exactly once.

The file may hold secret noise state: it is created with mode 0600 and must be kept as private
as the server itself. It is a pickle: load only checkpoints your own server wrote.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

from fedpriv.config import RunConfig

FORMAT = 1
SUFFIX = ".checkpoint"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or belongs to another run."""


def checkpoint_path(config: RunConfig) -> Path:
    """The configured checkpoint file, or the results path with suffix ``.checkpoint``."""
    raw = config.checkpoint_path or str(Path(config.results_path).with_suffix(SUFFIX))
    return Path(raw).expanduser().resolve()


def save(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, rename, fsync dir)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            pickle.dump({"format": FORMAT, **state}, fh, protocol=pickle.HIGHEST_PROTOCOL)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: nothing to resume (a finished run "
                              "removes its checkpoint)")
    try:
        with path.open("rb") as fh:
            state = pickle.load(fh)
    except Exception as err:  # a truncated or foreign file
        raise CheckpointError(f"checkpoint {path} is unreadable: {err!r}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has an unknown format")
    return state


def describe(path: Path) -> str:
    """One line on an existing checkpoint: steps done and epsilon spent."""
    state = load(path)
    return (f"{state['completed']} of {state['total_steps']} steps done, epsilon spent "
            f"{state['epsilon_spent']:.4g}")


def lock(path: Path) -> int:
    """Take the run's lock (``<checkpoint>.lock``, an exclusive ``flock`` held while the
    server lives; the OS releases it when the process dies). Raises if another live server
    holds it."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = lock_file(path)
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise CheckpointError(f"another server (pid {holder}) is running the run of "
                                  f"{path}; two servers would publish its releases twice") \
                from None
        # the holder before us may have removed the file (``remove``, ``store.close``) after
        # we opened it: a lock on that unlinked file would exclude no one, so take the lock of
        # the file now at the path
        try:
            current = os.stat(lock_path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def lock_file(path: Path) -> Path:
    """The lock file of the checkpoint at ``path``."""
    return path.with_name(path.name + ".lock")


def remove(path: Path) -> None:
    """Remove a finished run's checkpoint and its lock file."""
    path.unlink(missing_ok=True)
    lock_file(path).unlink(missing_ok=True)


def unlock(fd: int) -> None:
    os.close(fd)  # closing the descriptor releases the flock


PAUSE_ENV = "FEDPRIV_PAUSE_AFTER_STEP"


def pause_for_tests(completed: int) -> None:
    """Test hook: with ``FEDPRIV_PAUSE_AFTER_STEP=k`` the server sleeps (up to 120 s) right
    after checkpointing step k, so a test can kill it at a known point of the run."""
    if os.environ.get(PAUSE_ENV, "") == str(completed):
        import time

        time.sleep(120.0)

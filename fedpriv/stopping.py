"""Stopping a run whole: Ctrl-C, SIGTERM and a killed ``fedpriv`` end every process it started.

A command that starts processes (``fedpriv run``, ``sweep``, ``tune``, ``deploy submit``) runs
inside ``RunGuard``. The guard gives the command a token, exported in its environment
(``FEDPRIV_RUN_TOKEN``), so every process it starts inherits it: ``flwr run``, the local
run's local SuperLink and its SuperExec, ``flwr-simulation``, Ray's GCS, raylet and
workers, the ClientApp actors, a sweep's worker processes. Whatever their parent became
(Flower and Ray start their processes in sessions of their own, and re-parent them), they are
found by that token in ``/proc/<pid>/environ`` and stopped by PID: SIGTERM, then SIGKILL.

- SIGINT and SIGTERM become ``Interrupted`` in the command (a ``KeyboardInterrupt``): the
  command stops everything carrying its token, removes its folder (``folder``: the run's
  temporary files, Flower's state, Ray's session), prints one line (how to resume) and exits
  with 128 + the signal's number. No traceback.
- SIGKILL cannot be caught: a small watcher process (``python -m fedpriv.stopping``, started
  in a session of its own, without the token) polls the command's PID and does the same
  cleanup when the command is gone.

A checkpoint is written atomically after each complete step (``fedpriv.checkpoint``), so the
last complete step survives any of these, and nothing is released after the signal: the
processes that could release are gone before the command returns.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import FrameType, TracebackType

TOKEN_ENV = "FEDPRIV_RUN_TOKEN"
"""The variable every process of a guarded command carries (its value: the command's token)."""
FOLDER_ENV = "FEDPRIV_RUN_DIR"
"""The guarded command's own temporary folder (removed when it ends, however it ends)."""


SERVER_DONE = "fedpriv: the ServerApp is done"
"""The ServerApp's last line under a guarded command (with the command's token, so no other
run's line matches): its results are written, and what is left of the run is Flower's and
Ray's shutdown, which the command cuts short (``server_done_line``)."""


def server_done_line() -> str | None:
    """The line a ServerApp started by this guarded command prints when its work is done (None
    outside a guarded command: ``flwr run .`` directly, a deployment's SuperLink)."""
    token = os.environ.get(TOKEN_ENV)
    return f"{SERVER_DONE} ({token})" if token else None


WATCHER_ENV = ("PATH", "PYTHONPATH", "HOME", "LANG", "VIRTUAL_ENV", "TMPDIR")
"""What the watcher inherits: enough to start Python and import fedpriv."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_KEPT: set[int] = set()


def keep_running(pids: set[int]) -> None:
    """Leave these processes (and theirs) running when the command ends: the local SuperLink
    that ``fedpriv run --keep-superlink`` keeps."""
    _KEPT.update(pids)


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process (Linux /proc)."""
    parents = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            stat = Path(f"/proc/{name}/stat").read_text() if name.isdigit() else ""
            parents[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def _below(roots: set[int], parents: dict[int, int]) -> set[int]:
    """``roots`` and every process below them."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(roots), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def process_tree(root: int) -> set[int]:
    """``root`` and every process below it (Linux /proc)."""
    return _below({root}, _parents())


def tagged_pids(token: str) -> list[int]:
    """PIDs of the processes whose environment carries ``token``, and of every process below
    one of them (this one, and those kept running, excluded): a process keeps its parent's
    environment, but one that rewrites its title over it (Ray's dashboard and runtime-env
    agents) no longer shows the token, and outlives its parent's SIGKILL."""
    marker = f"{TOKEN_ENV}={token}".encode()
    parents = _parents()
    marked = set()
    for pid in parents:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            marked.add(pid)
    kept = _below(_KEPT, parents) if _KEPT else set()
    return sorted(_below(marked, parents) - kept - {os.getpid()})


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_tagged(token: str, grace: float = 10.0) -> int:
    """Stop every process carrying ``token``: first frozen (SIGSTOP: none of them completes
    another step or release from here on), then SIGTERM (and SIGCONT, so they act on it), up
    to ``grace`` seconds to exit, then SIGKILL; repeated while new ones appear (a process may
    start another as it stops). Returns how many were signalled."""
    signalled: set[int] = set()
    for _ in range(5):
        pids = [p for p in tagged_pids(token) if _alive(p)]
        if not pids:
            break
        signalled.update(pids)
        for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGCONT):
            for pid in pids:
                _signal(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        for pid in pids:
            if _alive(pid):
                _signal(pid, signal.SIGKILL)
    return len(signalled)


def stop_started(grace: float = 10.0) -> int:
    """Stop every process this guarded command started (none where it is not guarded);
    ``grace``: as ``stop_tagged``'s."""
    token = os.environ.get(TOKEN_ENV)
    return stop_tagged(token, grace) if token else 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _short_tmp() -> str:
    """A temporary directory with a short path: Ray's socket paths must stay under 107 bytes."""
    default = tempfile.gettempdir()
    return default if len(default) <= 24 or not os.path.isdir("/tmp") else "/tmp"


class RunGuard:
    """The context of one command that starts processes (see the module docstring)."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.folder = ""
        self._saved: dict[int, object] = {}
        self._watcher: subprocess.Popen[bytes] | None = None
        self._handlers = threading.current_thread() is threading.main_thread()
        self._env: dict[str, str | None] = {}

    def __enter__(self) -> RunGuard:
        self.folder = tempfile.mkdtemp(prefix=f"fedpriv-run-{os.getpid()}-", dir=_short_tmp())
        for key, value in ((TOKEN_ENV, self.token), (FOLDER_ENV, self.folder)):
            self._env[key] = os.environ.get(key)
            os.environ[key] = value
        # the watcher carries neither the token nor anything else of the run's environment:
        # whatever stops the run's processes by their environment leaves it to finish its job
        env = {k: os.environ[k] for k in WATCHER_ENV if k in os.environ}
        self._watcher = subprocess.Popen(
            [sys.executable, "-m", "fedpriv.stopping", str(os.getpid()), self.token,
             self.folder], env=env, start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for sig in (signal.SIGINT, signal.SIGTERM) if self._handlers else ():
            self._saved[sig] = signal.signal(sig, self._interrupt)
        return self

    @staticmethod
    def _interrupt(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cleanup runs to its end
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Interrupted(signum)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig in self._saved:  # no second interrupt mid-cleanup
            signal.signal(sig, signal.SIG_IGN)
        try:
            stop_tagged(self.token)
            shutil.rmtree(self.folder, ignore_errors=True)
            if self._watcher is not None:
                self._watcher.kill()
                self._watcher.wait()
        finally:
            for key, value in self._env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]


def run_folder() -> str | None:
    """The guarded command's temporary folder, where its runs put theirs (None: unguarded)."""
    folder = os.environ.get(FOLDER_ENV)
    return folder if folder and os.path.isdir(folder) else None


def watch(owner: int, token: str, folder: str, poll: float = 0.5) -> None:
    """The watcher: when ``owner`` is gone (killed, even by SIGKILL), stop every process
    carrying ``token`` and remove ``folder``."""
    while _alive(owner):
        time.sleep(poll)
    stop_tagged(token)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    for ignored in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the owner's to handle:
        signal.signal(ignored, signal.SIG_IGN)  # the watcher ends when its owner has ended
    watch(int(sys.argv[1]), sys.argv[2], sys.argv[3])

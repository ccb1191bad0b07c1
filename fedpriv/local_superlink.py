"""The local SuperLink of a Flower simulation run: started by fedpriv, found and stopped by port.

``flwr run`` starts a local SuperLink itself when none answers on its port, but gives it 15 s
(Flower's ``LOCAL_SUPERLINK_STARTUP_TIMEOUT``, not configurable) to answer: on a loaded
machine (two runs at once beside a test suite on 2 cores) its start-up took longer and the
run failed before it began. ``start_local_superlink`` starts the same process (Flower's
``flower-superlink`` in simulation mode, its state and log under ``FLWR_HOME/local-superlink``)
and waits for Flower's own health check with a limit of its own (``START_S``); ``flwr run``
then finds it running and submits to it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from fedpriv.deploy.commands import check_health

START_S = 120.0
"""Seconds a local SuperLink fedpriv starts has to answer its health check."""

DEFAULT_CONTROL_PORT = 39093
"""Flower's default Control API port of a local SuperLink (``FLWR_LOCAL_CONTROL_API_PORT``)."""


def port_open(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def healthy(port: int, timeout: float = 2.0) -> bool:
    """Whether a SuperLink answers Flower's health check (``GET /health``) on
    127.0.0.1:``port`` with a success."""
    return check_health(f"127.0.0.1:{port}", None, timeout)


def listening_pid(port: int) -> int | None:
    """PID of the process listening on 127.0.0.1:port (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].split(":")[1], 16) == port:
                inodes.add(cols[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


def stop_local_superlink(port: int) -> None:
    """Stop the process listening on 127.0.0.1:``port`` (SIGTERM, then SIGKILL after 10 s)."""
    pid = listening_pid(port)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    for _ in range(50):
        if not port_open(port):
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def start_local_superlink(port: int, control_port: int | None, env: dict[str, str], cwd: str,
                          timeout: float = START_S) -> subprocess.Popen[bytes]:
    """Start a local SuperLink on 127.0.0.1:``port`` as ``flwr run`` starts one, in a session
    of its own, in ``cwd``, with ``env`` (its ``FLWR_HOME``, relative to ``cwd`` as for Flower,
    holds its state and its log, appended to), and return it once it answers the health check.
    Raises RuntimeError, quoting what it logged, if it exits first (a port taken: another
    process's SuperLink answering there is not taken for it) or does not answer within
    ``timeout`` seconds (it is stopped then)."""
    home = Path(cwd, Path(env.get("FLWR_HOME") or Path.home() / ".flwr").expanduser())
    state = home.resolve() / "local-superlink"
    state.mkdir(parents=True, exist_ok=True)
    log_path = state / "superlink.log"
    control = control_port or int(env.get("FLWR_LOCAL_CONTROL_API_PORT", DEFAULT_CONTROL_PORT))
    with open(log_path, "a") as log:
        started = (f"--- fedpriv: starting flower-superlink on 127.0.0.1:{port}, "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
        log.write(started + "\n")
        log.flush()
        try:
            proc = subprocess.Popen(
                ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
                 "--control-api-address", f"127.0.0.1:{control}", "--host", "127.0.0.1",
                 "--port", str(port), "--database", str(state / "state.db")],
                cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**env, "FLWR_HOME": str(home.resolve()), "FLWR_DISABLE_UPDATE_CHECK": "1"},
                start_new_session=True)
        except OSError as e:
            raise RuntimeError(f"Flower's `flower-superlink` command could not start ({e}): "
                               "install fedpriv's dependencies in this environment "
                               "(pip install -e .)") from None
    deadline = time.monotonic() + timeout
    while not healthy(port) or proc.poll() is not None:  # not another process's SuperLink
        if proc.poll() is not None or time.monotonic() > deadline:
            why = (f"exited with code {proc.returncode}" if proc.poll() is not None
                   else f"did not answer within {timeout:.0f} s")
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            log_text = log_path.read_text(errors="replace")
            tail = log_text[log_text.rfind(started):].strip().splitlines()[-20:]
            raise RuntimeError(f"the local SuperLink on 127.0.0.1:{port} {why}; the end of its "
                               f"log ({log_path}):\n" + "\n".join(tail))
        time.sleep(0.2)
    return proc

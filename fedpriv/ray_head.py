"""A local Ray head, started in the background for one Flower run or for a session of runs.

Flower's simulation process starts Ray itself (``ray.init``) only once ``flwr run``, the local
SuperLink, its SuperExec and the simulation process have each started, one after the other:
about 3 s of Ray's own start-up on the path to the first round of every run (docs/results.md,
Start-up). A head started when the command starts (``RayHead``) gets ready while that chain
runs, and the simulation attaches to it with Ray's ``RAY_ADDRESS``. ``ray start`` runs as a
subprocess, found beside this interpreter (``tool_path``); Ray is never imported here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fedpriv.executables import tool_path

READY_LINE = "Ray runtime started"
"""What ``ray start --head`` prints once its GCS and raylet are up."""
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's setting that, at ``0``, keeps a driver (and a head) on the loopback address."""


def driver_env(address: str) -> dict[str, str]:
    """What a Ray driver's environment needs to attach to the cluster at ``address``: Ray's
    ``RAY_ADDRESS``, and for a loopback address ``RAY_LOOPBACK_ENV=0`` (without it, Ray on
    Linux replaces a loopback address by the machine's own IP, which a head bound to 127.0.0.1
    never answers: the driver hangs)."""
    env = {"RAY_ADDRESS": address}
    if address.startswith(("127.0.0.1:", "localhost:")):
        env[RAY_LOOPBACK_ENV] = "0"
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_group(leader: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds (at once for 0), to the process group
    ``leader`` started (its own session): every process of the group, the leader's children
    included, whether or not the leader is still running."""
    for sig in (signal.SIGTERM, signal.SIGKILL) if grace > 0 else (signal.SIGKILL,):
        try:
            os.killpg(leader.pid, sig)
        except ProcessLookupError:
            break  # the group is gone
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline:
            leader.poll()  # reap the leader
            if not group_running(leader.pid):
                break
            time.sleep(0.05)
        else:
            continue
        break
    leader.poll()


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies do not count: they hold nothing,
    and the children of a stopped leader are reaped by the init process in its own time
    (seconds, under some containers' init)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # no /proc: the group has members, zombies or not
    for pid in entries:
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


class RayHead:
    """``ray start --head --block`` on 127.0.0.1 with free ports, ``num_cpus`` logical CPUs,
    no dashboard, its session files in ``folder`` (keep its path short: Ray's socket paths are
    limited to 107 bytes), in a process group of its own, started without waiting for it.
    ``address`` is what a driver attaches with (``RAY_ADDRESS``, with Ray's
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which keeps the driver on the loopback address);
    Ray's driver retries the head's GCS while the head is still starting. ``env``: the head's
    environment, which its workers (the ClientApp actors) inherit."""

    def __init__(self, folder: str, num_cpus: int, env: dict[str, str]) -> None:
        self.folder = folder
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = Path(folder, "ray-head.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                 f"--port={self.port}", f"--num-cpus={num_cpus}", "--include-dashboard=false",
                 "--disable-usage-stats", f"--temp-dir={folder}",
                 f"--ray-client-server-port={free_port()}",
                 f"--dashboard-agent-listen-port={free_port()}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=tool_path({**env, RAY_LOOPBACK_ENV: "0"}))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def ready(self) -> bool:
        """Whether the head is up (its GCS and raylet)."""
        return READY_LINE in self.log()

    def exited(self) -> bool:
        """Whether ``ray start`` has exited: a head that will not come up (``--block`` keeps a
        working one running)."""
        return self.proc.poll() is not None

    def wait(self, timeout: float) -> bool:
        """Wait until the head is up: True, or False if it exited or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready():
                return True
            if self.exited():
                return False
            time.sleep(0.1)
        return False

    def watch(self, timeout: float, on_failure: Callable[[], object]) -> threading.Thread:
        """Call ``on_failure`` (from a daemon thread) if the head is not up within ``timeout``
        seconds (or exits first), with a line naming why and the end of its log."""
        def check() -> None:
            if not self.wait(timeout):
                state = "exited" if self.exited() else f"was not up after {timeout:g} s"
                print(f"fedpriv: the run's Ray head {state}; stopping the run. The end of its "
                      f"log:\n{self.log_tail()}", file=sys.stderr, flush=True)
                on_failure()

        thread = threading.Thread(target=check, name="ray-head-watch", daemon=True)
        thread.start()
        return thread

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().strip().splitlines()[-lines:])

    def stop(self, grace: float = 0.0) -> None:
        """Stop the head's process group (at once by default: a head of one run holds nothing
        to save)."""
        stop_group(self.proc, grace)

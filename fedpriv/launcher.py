"""The Flower simulation launcher behind ``fedpriv run`` and ``fedpriv sweep --engine flower``.

``run_flower`` writes the run config to a file, runs ``flwr run`` on this project's Flower app
with one SuperNode per cohort of users, on a local SuperLink of the run's own (free ports, a
private ``FLWR_HOME``: ``LocalSuperLink``, started here: ``fedpriv.local_superlink``), and
stops that SuperLink after it (found by its port, stopped by its PID). It starts ``flwr`` as
a subprocess, found beside this interpreter (``tool_path``), and never imports it; the
commands above it (``fedpriv.cli``, ``fedpriv.sweep``) share it from here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpriv.config import RunConfig
from fedpriv.config_files import app_config_keys, for_flower, toml_value
from fedpriv.cost import estimate
from fedpriv.data.cache import CACHE_MB_ENV, DEFAULT_CACHE_MB
from fedpriv.executables import tool_path
from fedpriv.local_superlink import listening_pid as _listening_pid
from fedpriv.local_superlink import port_open as _port_open
from fedpriv.local_superlink import start_local_superlink, stop_local_superlink
from fedpriv.nodes import auto_num_nodes
from fedpriv.outputs import unclaim
from fedpriv.ray_head import RayHead, driver_env
from fedpriv.ray_head import free_port as _free_port
from fedpriv.ray_head import stop_group as _stop_group
from fedpriv.stopping import (
    SERVER_DONE,
    keep_running,
    process_tree,
    run_folder,
    server_done_line,
    stop_started,
)

LOCAL_SUPERLINK_PORT_ENV = "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"
"""Flower's variable for the port of the local SuperLink ``flwr run`` submits to."""
LOCAL_CONTROL_PORT_ENV = "FLWR_LOCAL_CONTROL_API_PORT"
"""... and for its Control API's port."""


def project_dir() -> Path:
    """The Flower app: the source checkout (``pyproject.toml``) this package lives in."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise SystemExit(f"fedpriv: no Flower app (pyproject.toml) next to the package at {root}; "
                         "run from a source checkout")
    return root


NO_RUNTIME_INSTALL = "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"



def with_cache_share(env: dict[str, str], actors: int) -> dict[str, str]:
    """``env`` with each of ``actors`` ClientApp actors given its share of the default data
    cache (``FEDPRIV_CACHE_MB``), unless the user set one: the processes that start actors
    (a run's local SuperLink, a session's Ray head) pass it on to them."""
    env.setdefault(CACHE_MB_ENV, str(max(64, DEFAULT_CACHE_MB // max(1, actors))))
    return env


RAY_PRESTART_ENV = "RAY_prestart_worker_first_driver"
"""Ray's setting (read by its raylet) to start one idle Python worker per CPU when the first
driver connects."""


def actor_env(env: dict[str, str], actors: int) -> dict[str, str]:
    """The environment of a process that starts a simulation's ClientApp actors (the SuperLink
    of a run, a session's Ray head): each actor's share of the data cache
    (``with_cache_share``), and Ray's pre-started workers off unless the user set them
    (``RAY_PRESTART_ENV=0``): a simulation starts its actors itself, and the workers Ray
    pre-starts beside them import Ray for nothing (about 3.5 CPU-seconds and 1.3 s of a small
    run on 2 cores: docs/results.md, Start-up)."""
    env.setdefault(RAY_PRESTART_ENV, "0")
    return with_cache_share(env, actors)


CONNECTION = "fedpriv-local"
"""The name of the connection to a SuperLink of fedpriv's own in its ``config.toml``."""


@dataclass(frozen=True)
class LocalSuperLink:
    """The local SuperLink a run submits to. By default a run's own: free ports and a private
    ``FLWR_HOME`` (its state and logs), started before ``flwr run`` (``start_local_superlink``)
    and stopped after it, so a run never joins a SuperLink that another job (or user) started
    on Flower's default ports, and two runs at once never share one. ``named``: the user
    named one with Flower's variable ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``; a SuperLink
    already listening there is used (with the user's ``FLWR_HOME``) and left running."""

    port: int
    control_port: int | None
    home: str | None
    named: bool

    @classmethod
    def choose(cls, folder: str) -> LocalSuperLink:
        """The user's named SuperLink, or a fresh one whose FLWR_HOME is made in ``folder``."""
        named = os.environ.get(LOCAL_SUPERLINK_PORT_ENV)
        if named:
            return cls(int(named), None, None, True)
        return cls(_free_port(), _free_port(), tempfile.mkdtemp(prefix="flwr-", dir=folder),
                   False)

    def running(self) -> bool:
        return _port_open(self.port)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The environment of ``flwr run`` (and the SuperLink it starts) for this SuperLink."""
        env = tool_path({**base, LOCAL_SUPERLINK_PORT_ENV: str(self.port)})
        if self.control_port is not None:
            env[LOCAL_CONTROL_PORT_ENV] = str(self.control_port)
        if self.home is not None:
            env["FLWR_HOME"] = self.home
        return env

    def stop(self) -> None:
        stop_local_superlink(self.port)

    def connection(self) -> list[str]:
        """The SuperLink connection ``flwr run`` is given: for a SuperLink of fedpriv's own
        (its private ``FLWR_HOME``), one named ``CONNECTION`` with the SuperLink's address, so
        that ``flwr run`` takes it as running (Flower probes a local connection once, for
        0.4 s, and starts a second SuperLink on that port if the probe times out); none (the
        local one) for a SuperLink the user named."""
        if self.home is None:
            return []
        config = Path(self.home, "config.toml")
        if not config.is_file():
            config.write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
                              f'address = ":local:"\n\n[superlink.{CONNECTION}]\n'
                              f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')
        return [CONNECTION]


class FlowerSession:
    """One local SuperLink and one Ray head shared by several Flower runs (a sweep), so that
    start-up is paid once: a context manager that stops both on exit, Ctrl-C and errors
    included. The SuperLink is the session's own (``LocalSuperLink``); one the user named that
    is already running is used as it is (with its own Ray instances) and left running."""

    def __init__(self, num_cpus: int | None = None) -> None:
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self.ray_address: str | None = None
        self.link: LocalSuperLink | None = None
        self._head: RayHead | None = None
        self._superlink: subprocess.Popen[bytes] | None = None
        self._tmp: str | None = None
        self._stop_superlink = False

    @property
    def workdir(self) -> str | None:
        """Where the session's SuperLink starts (it outlives each run's own temp folder)."""
        return self._tmp

    def __enter__(self) -> FlowerSession:
        self._tmp = tempfile.mkdtemp(prefix="fpray", dir="/tmp")  # Ray's socket paths: short
        self.link = LocalSuperLink.choose(self._tmp)
        if self.link.named and self.link.running():
            return self  # the SuperLink the user named: use it, never stop it
        self._stop_superlink = True
        for _ in range(2):  # a head that exits at start-up (a port taken meanwhile) gets one retry
            head = self._head = RayHead(self._tmp, self.num_cpus,
                                        actor_env(dict(os.environ), self.num_cpus))
            if head.wait(timeout=120):
                self.ray_address = head.address
                return self
            if not head.exited():  # still starting after the deadline: no retry
                break
        tail = head.log_tail()
        self.__exit__(None, None, None)  # removes the log with the head's folder: quote it
        raise RuntimeError("the sweep's Ray head did not start; the end of its log:\n" + tail)

    def start_superlink(self) -> None:
        """Start the session's SuperLink now, as ``flwr run`` starts a local one (Flower's
        ``flower-superlink`` in simulation mode), attached to the session's Ray head, so that
        other processes submit to it by its port (``fedpriv run`` with
        ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` and ``FLWR_LOCAL_CONTROL_API_PORT`` set to
        ``link.port`` and ``link.control_port``). Without it, the session's first run starts it."""
        link = self.link
        if link is None or self.ray_address is None or self._tmp is None or link.named:
            raise RuntimeError("start_superlink needs an entered session of its own (not a "
                               "SuperLink named with FLWR_LOCAL_SUPERLINK_HTTP_API_PORT)")
        for _ in range(3):  # ports chosen at enter; Ray's head opens many since: choose again
            if not link.running():
                break
            link = self.link = LocalSuperLink.choose(self._tmp)
        else:
            raise RuntimeError(f"the session's SuperLink port {link.port} was taken meanwhile")
        env = actor_env(link.env({**os.environ, **driver_env(self.ray_address),
                                  NO_RUNTIME_INSTALL: os.environ.get(NO_RUNTIME_INSTALL, "1")}),
                        self.num_cpus)
        try:
            self._superlink = start_local_superlink(link.port, link.control_port, env, self._tmp)
        except RuntimeError as e:
            raise RuntimeError(f"the session's SuperLink did not start: {e}") from None

    def __exit__(self, *exc: object) -> None:
        if self._stop_superlink and self.link is not None:
            self.link.stop()
        self._stop_superlink = False
        if self._superlink is not None:  # each process group, what they started included:
            _stop_group(self._superlink)  # the group outlives a leader that has exited
        if self._head is not None:
            self._head.stop(grace=10.0)
        self._head = self._superlink = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)  # the head's logs and sockets
            self._tmp = None


HEAD_START_TIMEOUT = 120.0
"""Seconds the run's early Ray head has to come up before the run is stopped as failed."""


def early_ray_head(config: RunConfig, keep_superlink: bool,
                   ray_address: str | None) -> RayHead | None:
    """A Ray head for this run, started now in the background (``RayHead``), so that it gets
    ready while the command checks the config and Flower starts its processes; None where the
    run attaches to a cluster of the user's, keeps its SuperLink (which keeps its own Ray), or
    submits to a SuperLink the user named, or outside a guarded command (no run folder)."""
    folder = run_folder()
    named = os.environ.get(LOCAL_SUPERLINK_PORT_ENV, "")
    if (ray_address or keep_superlink or not folder
            or (named.isdigit() and _port_open(int(named)))):
        return None
    actors = client_actors(config, auto_num_nodes(config.num_users, config.users_per_node))
    try:
        return RayHead(folder, ray_cpus(config), actor_env(dict(os.environ), actors))
    except OSError:  # no `ray` command here: Flower's simulation starts Ray itself
        return None


def ray_cpus(config: RunConfig) -> int:
    """The logical CPUs of a run's own Ray instance: the machine's cores; more for a run whose
    simulated nodes time out (a node that times out holds its worker for node-timeout
    seconds: more workers than cores keep the others from queueing behind it)."""
    cores = os.cpu_count() or 1
    if config.node_fault_kind == "timeout" and config.node_fault_rate > 0:
        return max(8, 2 * cores)
    return cores


def run_flower(config: RunConfig, values: dict[str, Any], out: Path, keep_superlink: bool,
               quiet: bool = False, ray_address: str | None = None,
               session: FlowerSession | None = None, head: RayHead | None = None) -> int:
    """Run through Flower's simulation engine, on a local SuperLink of the run's own
    (``LocalSuperLink``; a session's, or one the user named). ``ray_address``: attach the
    simulation to that existing Ray cluster (Ray's ``RAY_ADDRESS``, inherited by the SuperLink
    of the run and by its simulation process) instead of starting a Ray
    instance of its own. ``session``: one of several runs sharing the session's SuperLink and
    Ray head. ``head``: the run's own Ray head (``early_ray_head``), attached to the same way;
    the caller stops it."""
    if head is not None and head.exited():  # e.g. a port taken meanwhile: Flower starts Ray
        print("fedpriv: the run's early Ray head exited; the simulation starts its own Ray. "
              "The end of the head's log:\n" + head.log_tail(), file=sys.stderr)
        head = None
    ray_address = head.address if head is not None else ray_address
    folder = run_folder()  # the guarded command's: removed however the command ends
    with tempfile.TemporaryDirectory(prefix="fedpriv-run-", dir=folder) as tmp:
        if session is not None and session.link is not None:
            link, keep_superlink = session.link, True
            started_here = session.ray_address is not None and not link.running()
            ray_address = session.ray_address if started_here else None  # it already has it
        else:  # kept: its FLWR_HOME must outlive this run's folder
            link = LocalSuperLink.choose(tempfile.mkdtemp(prefix="fedpriv-superlink-")
                                         if keep_superlink else tmp)
            started_here = not link.running()
        # run the app from the environment fedpriv is installed in: no per-run dependency
        # installation (uv sync) by the run's SuperLink, unless asked for
        env = link.env({**os.environ, NO_RUNTIME_INSTALL: os.environ.get(NO_RUNTIME_INSTALL,
                                                                          "1")})
        if env.get("FLWR_HOME"):  # `flwr run` and the SuperLink run in other folders
            env["FLWR_HOME"] = str(Path(env["FLWR_HOME"]).expanduser().resolve())
        if env.get("PYTHONPATH"):  # the apps run in other folders: `PYTHONPATH=.` means here
            env["PYTHONPATH"] = os.pathsep.join(
                str(Path(p).resolve()) if p else p for p in env["PYTHONPATH"].split(os.pathsep))
        if folder and not ray_address and started_here and not keep_superlink:
            # Ray's session files: the run's own, removed with its folder
            env.setdefault("RAY_TMPDIR", folder)
        if ray_address and head is not None and not started_here:
            ray_address = None  # a SuperLink the user named started meanwhile: its own Ray
        if ray_address:
            if not started_here:
                print(f"fedpriv: --ray-address needs a fresh local SuperLink, but the one named "
                      f"on 127.0.0.1:{link.port} is running (it would keep its own Ray "
                      "instance); stop it first", file=sys.stderr)
                return 2
            env.update(driver_env(ray_address))
        if not started_here and session is None:
            # a SuperLink already running does not carry this command's token (the claim's
            # proof of ownership): its ServerApp would take the claim for another run's
            unclaim(out)
        code = _flwr_run(config, values, out, env, link, quiet, tmp, session,
                         stop=started_here and not keep_superlink, ray_address=ray_address,
                         head=head if ray_address else None)
    if code == 0 and started_here and keep_superlink and session is None:
        kept = _listening_pid(link.port)
        keep_running(process_tree(kept) if kept else set())
        print(f"fedpriv: the local SuperLink keeps running on 127.0.0.1:{link.port} "
              f"(FLWR_HOME={link.home or os.environ.get('FLWR_HOME', '~/.flwr')}); stop it "
              f"with: kill {_listening_pid(link.port) or '<its PID>'}", file=sys.stderr)
    return code


NOISE = ("default simulated SuperNodes changed", "To change federation size",
         "flwr federation simulation-config", "Flower configuration not found",
         "Successfully installed fedpriv to", "Manually terminating ClientAppActor",
         "warnings.warn(", "Starting logstream for run_id",
         "FutureWarning: Tip: In future versions of Ray, Ray will no longer override")
"""Lines of ``flwr run``'s stream that say nothing about the run to a fedpriv user: Flower's
note on its default federation size (fedpriv sets the size: ``num-supernodes``), its app
installation in the run's private ``FLWR_HOME``, Ray's shutdown of the actors, and Ray's
warning on a coming change of GPU visibility (filtered, not silenced with Ray's variable
``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0``, which would show every CPU actor the GPUs now)."""


def flower_noise(line: str) -> bool:
    """Whether ``line`` of ``flwr run``'s output is noise (``NOISE``), or an empty log line."""
    text = line.strip()
    return any(n in text for n in NOISE) or text in ("", "\x1b[92mINFO \x1b[0m:")


SMALL_RUN_S = 2.0
"""A run whose users' work and node messages are estimated below this many seconds
(``fedpriv.cost``, ``MESSAGE_S``) gets one ClientApp actor: a second one costs more to start
(about 3 CPU-seconds of imports, while the other processes of the run start too) than it saves."""

MESSAGE_S = 2.4e-3
"""A message to a node in Flower's simulation engine, counted as users' work: a second actor
overlaps the engine's calls and saved 1.0-1.4 ms a message at 1,000 nodes on 2 cores, 10%
crashing (a distributed round's 1,000 messages 4.0 -> 3.0 s, a secure round's 4,000 20.9 ->
15.4 s), about what it saves on 2.4 ms of users' work (which it halves)."""


def client_actors(config: RunConfig, nodes: int) -> int:
    """The ClientApp actors of a simulation: one per core (at most one per node), or one for a
    small run. A run whose nodes time out keeps one per core (more logical CPUs are given to
    Ray for it: a node that times out holds its actor)."""
    per_core = min(nodes, os.cpu_count() or 1)
    if config.node_fault_kind == "timeout" and config.node_fault_rate > 0:
        return per_core
    est = estimate(config)
    work = sum(t.value for t in est.time if t.name == "user work")
    stages = 1
    if config.aggregation == "secure":
        from fedpriv.server.secagg import EXCHANGES  # a secure step: three exchanges

        stages = EXCHANGES
    messages = est.steps * nodes * stages
    return 1 if work + messages * MESSAGE_S < SMALL_RUN_S else per_core


def _flwr_run(config: RunConfig, values: dict[str, Any], out: Path, env: dict[str, str],
              link: LocalSuperLink, quiet: bool, tmp: str, session: FlowerSession | None,
              stop: bool, ray_address: str | None, head: RayHead | None = None) -> int:
    """``flwr run`` of the run's config in ``env``; the SuperLink stopped after it if
    ``stop``."""
    nodes = auto_num_nodes(config.num_users, config.users_per_node)
    run_config = Path(tmp) / "run-config.toml"
    # absolute paths: the ServerApp and ClientApps resolve relative ones against their own cwd
    paths = {key: str(Path(str(values[key])).expanduser().resolve())
             for key in ("data-file", "data-dir") if str(values.get(key, "")).strip()}
    flower_values = for_flower({**values, **paths, "results-path": str(out)},
                               app_config_keys(project_dir()))
    run_config.write_text("".join(f"{key} = {toml_value(value)}\n"
                                  for key, value in flower_values.items()))
    # one ClientApp actor per core (Flower's default gives each actor 2 CPUs: one actor on a
    # 2-core machine), or one for a small run; each with its share of the data cache
    actors = client_actors(config, nodes)
    cores = os.cpu_count() or 1
    federation = f"num-supernodes={nodes} client-resources-num-cpus={max(1, cores // actors)}"
    actor_env(env, actors)
    logical = ray_cpus(config)
    if logical > cores and not ray_address:  # a cluster's CPUs are its own
        federation += f" init-args-num-cpus={logical}"
    cmd = ["flwr", "run", str(project_dir()), *link.connection(), "--stream", "--run-config",
           str(run_config), "--federation-config", federation]
    if not quiet:
        print(f"fedpriv: launching Flower simulation with {nodes} SuperNodes "
              f"({config.num_users} users) on a local SuperLink at 127.0.0.1:{link.port}",
              flush=True)
    # a SuperLink that outlives this run must not start in this run's temp folder
    workdir = session.workdir if session is not None and session.workdir else tmp
    superlink = None
    if not link.running():  # started here, as `flwr run` would, with more time than its 15 s
        try:  # (a kept SuperLink outlives the run's folder: it runs in its FLWR_HOME)
            superlink = start_local_superlink(link.port, link.control_port, env,
                                              link.home or workdir)
        except RuntimeError as e:
            print(f"fedpriv: {e}", file=sys.stderr)
            return 1
        if session is not None:
            session._superlink = superlink  # stopped with the session
    try:
        # a session of its own: a terminal's Ctrl-C reaches fedpriv alone, which then stops
        # every process of the run by PID (fedpriv.stopping), the SuperLink's included
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        if head is not None:  # a head that never comes up would leave the driver retrying
            head.watch(HEAD_START_TIMEOUT, proc.kill)
    except FileNotFoundError:
        print(f"fedpriv: Flower's `flwr` command was found neither beside {sys.executable} "
              "nor on PATH: install fedpriv's dependencies in this environment "
              "(pip install -e .)", file=sys.stderr)
        if stop and superlink is not None:
            _stop_group(superlink)
        return 1
    done, finished = server_done_line(), False
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(SERVER_DONE):  # never shown; another command's is not ours
                finished = finished or line.strip() == done
                if finished and stop:
                    # the results are written; what is left is Flower's and Ray's orderly
                    # shutdown (seconds): on a SuperLink of the run's own, the run's processes
                    # get a second to exit on SIGTERM (Ray's workers may wait on a raylet that
                    # is stopping too), then SIGKILL
                    stop_started(grace=1.0)
                    break
                continue
            if not quiet and not flower_noise(line):
                print(line, end="", flush=True)
        proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: fedpriv.stopping stops the rest
            proc.kill()
            proc.wait()
        if stop:
            link.stop()
            if superlink is not None:  # what it started too; reaped
                _stop_group(superlink, grace=1.0)
    if (proc.returncode != 0 and not finished) or not out.is_file():
        print(f"fedpriv: the Flower run did not complete (exit {proc.returncode}, results "
              f"{'missing' if not out.is_file() else 'present'})", file=sys.stderr)
        return 1
    return 0

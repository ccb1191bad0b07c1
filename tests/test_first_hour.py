"""A new user's first hour: an install without torch runs everything but the deep family,
`flwr run .` as the README writes it, a run that stays on a SuperLink of its own, works from an
environment that is not activated, never replaces an earlier run's files, and threads that
wait without spinning."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BLOCK_TORCH = """import sys

class NoTorch:  # as if torch were not installed: `import torch` raises ModuleNotFoundError
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTorch())
"""


def python(code: str, env: dict | None = None, cwd: Path | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


# ----- an install without torch ------------------------------------------------------------------
def test_without_torch_everything_but_the_deep_family_runs(tmp_path):
    """`pip install -e .` installs no torch: the default job runs, the deep algorithms are
    listed and refused before the run with how to install torch, and nothing imported it."""
    code = BLOCK_TORCH + f"""
from fedpriv.cli import main
from fedpriv.registry import available
assert main(["run", "--engine", "inprocess", "--out", {str(tmp_path / "r.json")!r},
             "--set", "num-users=300", "--set", "rounds=2"]) == 0
assert "deep-private-fedrep" in available()
assert main(["run", "--engine", "inprocess", "--set", "algorithm=deep-private-fedrep"]) == 2
import clients.app, strategies.server_app  # the Flower app loads too
print("torch loaded:", "torch" in sys.modules)
"""
    proc = python(code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch loaded: False" in proc.stdout
    assert "algorithm: deep-private-fedrep needs PyTorch, which is not installed" in proc.stderr
    assert "download.pytorch.org/whl/cpu" in proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["metrics"]["population_mse"] > 0


def test_the_stand_ins_declare_what_the_deep_algorithms_declare():
    from fedpriv.algorithms.deep.without_torch import stand_ins
    from fedpriv.registry import get_algorithm

    for stand_in in stand_ins():
        real = get_algorithm(stand_in.name)
        assert (stand_in.private, stand_in.summary) == (real.private, real.summary)
        assert stand_in.declared_params() == real.declared_params()
        assert dict(stand_in.defaults) == dict(real.defaults)
        assert stand_in.components == real.components
    assert len(stand_ins()) == sum(n.startswith(("deep-", "fewshot-")) for n in _names())


def _names() -> list[str]:
    from fedpriv.registry import available

    return available()


def test_the_package_declares_torch_only_for_the_deep_family():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("torch") for d in project["dependencies"])
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["deep"])


# ----- threads ------------------------------------------------------------------------------
def test_openmp_threads_sleep_while_they_wait_unless_the_user_says_otherwise():
    show = "import fedpriv, os; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert python(show, env=env).stdout.strip() == "PASSIVE"
    assert python(show, env={**env, "OMP_WAIT_POLICY": "ACTIVE"}).stdout.strip() == "ACTIVE"


# ----- results are never replaced ----------------------------------------------------------------
def test_a_run_without_out_never_replaces_an_earlier_runs_report(tmp_path, monkeypatch,
                                                                 capsys):
    from fedpriv.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["run", "--engine", "inprocess", "--set", "num-users=300", "--set", "rounds=1"]
    assert main(args) == 0 and main(args) == 0
    results = tmp_path / "results"
    assert (results / "run.operator.json").is_file()
    assert (results / "run-2.operator.json").is_file()
    assert (results / "run-2.release.json").is_file()
    assert "holds an earlier run's results; this run writes run-2" in capsys.readouterr().err
    named = [*args, "--out", str(results / "run.operator.json")]
    before = (results / "run.operator.json").read_bytes()
    assert main(named) == 2  # named, and taken: refused, nothing lost
    assert "--overwrite" in capsys.readouterr().err
    assert (results / "run.operator.json").read_bytes() == before
    assert main([*named, "--overwrite"]) == 0  # asked for


# ----- Flower: its own SuperLink, no activation needed, `flwr run .` -------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Listener:
    """Something listening where Flower's defaults point (39091, 39093), counting who
    connects: a run that joined it would be submitting to a SuperLink it did not start."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(("127.0.0.1", port))
        except OSError:  # taken by somebody else's SuperLink: the same test, with theirs
            self.sock.close()
            self.sock = None
            return
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.connections = 0
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        if self.sock is not None:
            self._stop = True
            self._thread.join()
            self.sock.close()


@pytest.fixture
def short_dir():
    """A folder with a short path (Ray's socket paths must stay under 107 bytes)."""
    folder = tempfile.mkdtemp(prefix="fp", dir="/tmp")
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def flower_env(folder: Path, name: str) -> dict:
    """A Flower environment of one's own (FLWR_HOME, Ray's temp) without naming a SuperLink."""
    home = folder / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_LOCAL_")}
    env.update({"FLWR_HOME": str(home / "flwr"), "RAY_TMPDIR": str(home / "ray"),
                "FLWR_TELEMETRY_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    env.pop("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", None)  # fedpriv run sets it
    (home / "ray").mkdir(parents=True)
    return env


SLOW_SUPERLINK_S = 17
"""Seconds the slow SuperLink below waits before it starts: more than the 15 s that `flwr run`
gives a local SuperLink it starts (a loaded CI machine once took longer)."""


def slow_superlink_environment(folder: Path) -> Path:
    """An interpreter in ``folder/bin`` (this one, linked; a virtual environment's
    ``pyvenv.cfg`` and ``lib`` linked too) whose scripts folder holds this environment's
    commands, except ``flower-superlink``: it starts SLOW_SUPERLINK_S seconds late."""
    scripts, real = folder / "bin", Path(sys.executable).parent
    scripts.mkdir(parents=True)
    if (Path(sys.prefix) / "pyvenv.cfg").is_file():
        shutil.copy(Path(sys.prefix) / "pyvenv.cfg", folder / "pyvenv.cfg")
        for name in ("lib", "lib64"):
            if (Path(sys.prefix) / name).exists():
                (folder / name).symlink_to(Path(sys.prefix) / name)
    python = scripts / "python3"
    python.symlink_to(sys.executable)
    for tool in real.iterdir():
        if tool.name.startswith(("flwr", "flower-", "ray")) and tool.name != "flower-superlink":
            (scripts / tool.name).symlink_to(tool)
    slow = scripts / "flower-superlink"
    slow.write_text(f"#!/bin/sh\nsleep {SLOW_SUPERLINK_S}\n"
                    f"exec {shlex.quote(str(real / 'flower-superlink'))} \"$@\"\n")
    slow.chmod(0o755)
    return python


@pytest.mark.integration
def test_two_runs_at_once_each_run_on_a_superlink_of_their_own(tmp_path, short_dir):
    """Two `fedpriv run` jobs started at once, with two FLWR_HOMEs, while something listens on
    Flower's default SuperLink ports: each runs on a SuperLink it started on free ports (and
    stopped), nothing connects to the default ports; one of them runs from an environment
    that is not activated (PATH lacks its scripts: `flwr` is found beside its interpreter),
    whose SuperLink takes longer to start than `flwr run` would wait for one."""
    slow_python = slow_superlink_environment(short_dir / "slow")
    listeners = [Listener(39091), Listener(39093)]
    try:
        procs = []
        for name, path in (("a", os.environ.get("PATH", "")), ("b", "/usr/bin:/bin")):
            env = {**flower_env(short_dir, name), "PATH": path}
            cmd = [sys.executable if name == "a" else str(slow_python), "-m", "fedpriv.cli",
                   "run", "--out",
                   str(tmp_path / f"{name}.json"), "--set", "num-users=400", "--set",
                   "rounds=2", "--set", f"seed={ord(name)}"]
            procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        logs = [p.communicate(timeout=480)[0] for p in procs]
    finally:
        for listener in listeners:
            listener.close()
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]
    ports = [int(re.search(r"on a local SuperLink at 127\.0\.0\.1:(\d+)", log).group(1))
             for log in logs]
    assert len(set(ports)) == 2 and 39091 not in ports
    assert all(listener.sock is None or listener.connections == 0 for listener in listeners)
    runs = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("a", "b")]
    assert all(r["runtime"] == "flower" and r["metrics"] for r in runs)
    assert runs[0]["metrics"] != runs[1]["metrics"]  # two runs (two seeds), not one twice
    for port in ports:  # each stopped its own
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.integration
def test_flwr_run_as_the_readme_writes_it_completes_the_default_job(tmp_path, short_dir):
    """The README's `flwr run` line (here on a free port, so as not to meet another job's
    SuperLink): the default job completes, and the output says where its results are. The
    SuperLink it leaves running is stopped by its PID."""
    from fedpriv.launcher import _listening_pid

    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith(
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run ."))
    env = flower_env(short_dir, "readme")
    port = _free_port()
    env.update({"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port),
                "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    command = line.split("#")[0].strip().replace(" flwr run . ", f" flwr run {ROOT} ")
    earlier = tmp_path / "results" / "run.operator.json"  # an earlier `fedpriv run`'s report
    earlier.parent.mkdir()
    earlier.write_text('{"document": "an earlier run"}')
    try:
        proc = subprocess.run(command, shell=True, env=env, cwd=tmp_path, text=True,
                              capture_output=True, timeout=480)
    finally:
        pid = _listening_pid(port)
        if pid is not None:
            os.kill(pid, 15)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    where = re.search(r"operator report \(exact, not private; do not publish\): (\S+)", log)
    assert where and Path(where.group(1)).is_file(), log[-3000:]
    assert Path(where.group(1)) == tmp_path / "results" / "run-2.operator.json"
    assert earlier.read_text() == '{"document": "an earlier run"}'  # not overwritten
    assert "Installing application dependencies" not in log


@pytest.mark.integration
def test_a_kept_superlink_outlives_its_command_and_takes_the_next_run(tmp_path, short_dir):
    """`fedpriv run --keep-superlink`: the SuperLink stays after the command ends (its run
    folder removed), says its port, FLWR_HOME and PID, takes a second run submitted to it as
    the user's named SuperLink (and is left running by it), and stops by that PID."""
    from fedpriv.stopping import process_tree

    env = flower_env(short_dir, "keep")
    base = [sys.executable, "-m", "fedpriv.cli", "run", "--set", "num-users=200", "--set",
            "rounds=1"]
    pid = None
    try:
        first = subprocess.run([*base, "--keep-superlink", "--out", str(tmp_path / "a.json")],
                               env=env, cwd=tmp_path, text=True, capture_output=True,
                               timeout=480)
        kept = re.search(r"keeps running on 127\.0\.0\.1:(\d+) \(FLWR_HOME=(\S+)\); stop it "
                         r"with: kill (\d+)", first.stderr)
        assert first.returncode == 0 and kept, (first.stdout + first.stderr)[-3000:]
        port, home, pid = int(kept.group(1)), kept.group(2), int(kept.group(3))
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) == 0  # still there after the command
        second = subprocess.run(
            [*base, "--set", "seed=2", "--out", str(tmp_path / "b.json")],
            env={**env, "FLWR_HOME": home, "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port)},
            cwd=tmp_path, text=True, capture_output=True, timeout=480)
        assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
        assert f"on a local SuperLink at 127.0.0.1:{port}" in second.stdout
        runs = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b")]
        assert all(r["runtime"] == "flower" for r in runs)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) == 0  # a named SuperLink is left running
    finally:
        tree = process_tree(pid) if pid is not None else set()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
        for _ in range(100):  # the SuperLink closes its port as it stops
            with socket.socket() as s:
                if pid is None or s.connect_ex(("127.0.0.1", port)) != 0:
                    break
            time.sleep(0.1)
        for leftover in tree - {pid}:  # what the SuperLink started (SuperExec, ...)
            try:
                os.kill(leftover, signal.SIGKILL)
            except ProcessLookupError:
                pass
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, f"the kept SuperLink {pid} still answers"

"""A run the user controls: no result overwritten (claims), and real signals stop a run whole.

Signals go to real ``fedpriv run`` processes: SIGTERM and SIGINT (a terminal's Ctrl-C, to the
command's process group) on both engines, SIGKILL then a rerun through Flower. Each run is
marked with a variable of the test's own, inherited by every process it starts, so the test
sees every process of the run wherever it was re-parented, and checks none is left.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from fedpriv import checkpoint
from fedpriv.outputs import OutputTaken, claim, claim_folder, claim_free, unclaim, write_outputs

QUICK = ["--set", "num-users=300", "--set", "rounds=6", "--set", "dim=10",
         "--set", "users-per-node=100"]


def _marked(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
                state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if marker.encode() in environ and state != "Z":
                found.append(int(name))
    return found


def _holding(folder: str) -> list[int]:
    """Processes with a file open (or their working directory) under ``folder``: Ray's
    dashboard and runtime-env agents write their logs in the Ray session folder, and rewrite
    their title over their environment, where the marker was."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            links = [os.readlink(f"/proc/{name}/cwd")] + [
                os.readlink(f"/proc/{name}/fd/{fd}") for fd in os.listdir(f"/proc/{name}/fd")]
        except OSError:
            continue
        if any(link.startswith(folder.rstrip("/") + "/") for link in links):
            found.append(int(name))
    return found


def _left(env: dict, marker: str) -> list[int]:
    """The run's processes still alive: marked, or holding its Ray session's files."""
    return sorted(set(_marked(marker)) | set(_holding(env["RAY_TMPDIR"])))


@pytest.fixture
def run_env(flower_env):
    """The Flower environment, a short private TMPDIR (the run's folder goes there) and a
    marker inherited by every process a run starts."""
    tmp = tempfile.mkdtemp(prefix="fpc", dir="/tmp")
    marker = f"FEDPRIV_TEST_RUN={uuid.uuid4().hex}"
    env = {**flower_env, "TMPDIR": tmp, marker.split("=")[0]: marker.split("=")[1]}
    yield env, marker, Path(tmp)
    leftover = _left(env, marker)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert not leftover, f"processes of the run left behind: {leftover}"
    left = list(Path(tmp).iterdir())
    subprocess.run(["rm", "-rf", tmp], check=False)
    assert not left, f"folders of the run left behind: {left}"


def _start(argv: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as fh:
        return subprocess.Popen([sys.executable, "-m", "fedpriv.cli", *argv], env=env, cwd=cwd,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_step(ckpt: Path, step: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if checkpoint.load(ckpt)["completed"] == step:
                return
        except (checkpoint.CheckpointError, OSError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"no checkpoint of step {step}:\n{log.read_text()[-3000:]}")


# ----- claims: nothing overwritten ---------------------------------------------------------
REPORT = {"algorithm": "x", "num_users": 1, "config": {"algorithm": "private-fedrep"},
          "privacy": {"epsilon": 1.0, "ledger": [], "noise": "seeded"}, "server_state": {},
          "rounds": []}


def test_a_writer_never_replaces_another_runs_files(tmp_path, capsys):
    first, _ = write_outputs(REPORT, tmp_path / "run.operator.json")
    before = first.read_bytes()
    second, release = write_outputs({**REPORT, "num_users": 2}, tmp_path / "run.operator.json")
    assert second.name == "run-2.operator.json" and release.name == "run-2.release.json"
    assert first.read_bytes() == before
    assert "run-2.operator.json" in capsys.readouterr().err
    assert not list(tmp_path.glob(".*.claim"))  # the writer's own claims given up


def test_a_live_claim_of_another_process_is_respected_and_a_dead_ones_is_taken_over(tmp_path):
    target = tmp_path / "r.operator.json"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from fedpriv.outputs import claim; "
         f"claim({str(target)!r}); print('claimed', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(OutputTaken, match=f"pid {holder.pid}"):
            claim(target)
        assert claim_free(target).name == "r-2.operator.json"  # the next free name
        unclaim(tmp_path / "r-2.operator.json")
        written, _ = write_outputs(REPORT, target)
        assert written.name == "r-2.operator.json" and not target.exists()
    finally:
        holder.kill()
        holder.wait()
    assert claim(target) is True  # its holder is gone: a stale claim, taken over
    unclaim(target)


def test_an_output_folder_is_claimed_or_numbered(tmp_path):
    folder = tmp_path / "tune"
    assert claim_folder(folder, "tuning-report.json", named=False) == folder
    (folder / "tuning-report.json").write_text("{}")
    unclaim(folder / "folder.json")
    assert claim_folder(folder, "tuning-report.json", named=False) == tmp_path / "tune-2"
    with pytest.raises(OutputTaken, match="earlier run"):
        claim_folder(folder, "tuning-report.json", named=True)
    assert claim_folder(folder, None, named=True) == folder  # a sweep's: reused, not rewritten


def test_a_named_result_is_never_replaced_unless_asked(tmp_path):
    out = tmp_path / "mine.json"
    cmd = [sys.executable, "-m", "fedpriv.cli", "run", "--engine", "inprocess", *QUICK,
           "--out", str(out)]
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    before = out.read_bytes()
    again = subprocess.run([*cmd, "--set", "seed=2"], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 2 and "--overwrite" in again.stderr and "not overwritten" in (
        again.stderr)
    assert out.read_bytes() == before
    replaced = subprocess.run([*cmd, "--set", "seed=2", "--overwrite"], capture_output=True,
                              timeout=120)
    assert replaced.returncode == 0 and out.read_bytes() != before


def test_two_runs_started_together_write_two_results(tmp_path):
    cmd = [sys.executable, "-m", "fedpriv.cli", "run", "--engine", "inprocess", *QUICK]
    runs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [r.communicate(timeout=180)[0] for r in runs]
    assert [r.returncode for r in runs] == [0, 0], outputs
    reports = sorted(p.name for p in (tmp_path / "results").glob("*.operator.json"))
    assert reports == ["run-2.operator.json", "run.operator.json"]
    assert sorted(p.name for p in (tmp_path / "results").glob("*.release.json")) == [
        "run-2.release.json", "run.release.json"]
    assert not list((tmp_path / "results").glob(".*.claim"))


# ----- signals ------------------------------------------------------------------------------
def test_sigterm_stops_an_in_process_run_keeping_its_checkpoint(tmp_path, run_env):
    env, _, _ = run_env
    out = tmp_path / "r.json"
    argv = ["run", "--engine", "inprocess", *QUICK, "--out", str(out)]
    log = tmp_path / "first.log"
    proc = _start(argv, {**env, checkpoint.PAUSE_ENV: "2"}, tmp_path, log)
    _wait_for_step(tmp_path / "r.checkpoint", 2, proc, log)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    text = log.read_text()
    assert "Traceback" not in text and "stopped by SIGTERM" in text and "--resume" in text
    assert not out.exists() and checkpoint.load(tmp_path / "r.checkpoint")["completed"] == 2
    resumed = subprocess.run([sys.executable, "-m", "fedpriv.cli", *argv, "--resume"],
                             env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads(out.read_text())["resumed_from_step"] == 2


@pytest.mark.integration
def test_ctrl_c_and_sigkill_stop_a_flower_run_whole_and_it_resumes(tmp_path, run_env):
    """Ctrl-C (SIGINT to the command's process group) while the ServerApp holds after step 2:
    every process of the run (flwr run, SuperLink, SuperExec, flwr-simulation, Ray, actors)
    stops, no step is completed after it, one line says how to resume. Then a resumed run is
    SIGKILLed after step 3: its watcher stops the rest; a second resume finishes the run."""
    env, marker, _ = run_env
    out = tmp_path / "r.json"
    ckpt = tmp_path / "r.checkpoint"
    argv = ["run", *QUICK, "--out", str(out)]
    log = tmp_path / "first.log"
    proc = _start(argv, {**env, checkpoint.PAUSE_ENV: "2"}, tmp_path, log)
    _wait_for_step(ckpt, 2, proc, log)
    assert len(_marked(marker)) > 4  # flwr run, SuperLink, SuperExec, simulation, Ray ...
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=90) == 128 + signal.SIGINT, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text and "stopped by Ctrl-C" in text and "--resume" in text
    assert _left(env, marker) == [], "a process of the run outlived the command"
    time.sleep(2.0)
    assert checkpoint.load(ckpt)["completed"] == 2 and not out.exists()  # no ε after it

    log = tmp_path / "second.log"
    proc = _start([*argv, "--resume"], {**env, checkpoint.PAUSE_ENV: "3"}, tmp_path, log)
    _wait_for_step(ckpt, 3, proc, log)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 60
    while _left(env, marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _left(env, marker) == [], "the watcher did not stop the killed command's processes"
    assert checkpoint.load(ckpt)["completed"] == 3 and not out.exists()

    done = subprocess.run([sys.executable, "-m", "fedpriv.cli", *argv, "--resume"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["resumed_from_step"] == 3 and not ckpt.exists()
    assert "done in" in done.stdout
    assert "default simulated SuperNodes changed" not in done.stdout  # Flower's noise
    assert "FutureWarning" not in done.stdout + done.stderr  # Ray's
    # the ServerApp's last line, which stopped the run's processes when its results were
    # written, is the command's own (the fixture checks that none is left, Ray's agents too)
    assert "the ServerApp is done" not in done.stdout + done.stderr


# ----- progress and quiet output -----------------------------------------------------------
def test_a_long_step_shows_progress_and_a_short_one_does_not():
    from fedpriv.progress import StepProgress, Waiting

    lines: list[str] = []
    quick = StepProgress("final", 4, lines.append)  # after 5 s: nothing for a quick step
    for k in range(4):
        quick.done(k)
    assert lines == []
    slow = StepProgress("final", 4, lines.append, after=0.0, every=0.0)
    for k in range(1, 4):
        slow.done(k)
    assert lines[0].strip().startswith("final: 1/4 nodes done") and len(lines) == 3
    lines.clear()
    with Waiting("round-3", 10, lines.append, every=0.05):
        time.sleep(0.3)
    assert lines and all("round-3: waiting for 10 nodes' replies" in x for x in lines)


def test_flowers_noise_is_filtered_and_the_run_kept():
    from fedpriv.launcher import flower_noise

    assert flower_noise("\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated "
                        "SuperNodes changed from 10 to 2.\n")
    assert flower_noise("/x/ray/_private/worker.py:2051: FutureWarning: Tip: In future "
                        "versions of Ray, Ray will no longer override accelerator visible\n")
    assert not flower_noise("fedpriv: noise multipliers init=5.975, round=13.36\n")
    assert not flower_noise("[2/7] round-1    epsilon_spent=0.7597\n")


def test_a_small_run_gets_one_clientapp_actor_and_a_large_one_one_per_core(monkeypatch):
    """The actor count follows the users' estimated work (fedpriv.cost) and node messages: the
    default job's 0.1 s of user work gets one actor (a second would cost more to start than it
    saves), a deep Fashion-MNIST run one per core, and so does a run whose nodes time out."""
    from fedpriv.configure import parse_config
    from fedpriv.launcher import client_actors

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert client_actors(parse_config({}), nodes=10) == 1
    deep = parse_config({"algorithm": "deep-private-fedrep", "dataset": "fashion-mnist",
                         "num-users": 2000})
    assert client_actors(deep, nodes=10) == 4
    assert client_actors(deep, nodes=3) == 3  # never more actors than nodes
    timeouts = parse_config({"node-fault-rate": 0.2, "node-fault-kind": "timeout"})
    assert client_actors(timeouts, nodes=10) == 4
    # node messages count too (launcher.MESSAGE_S each; a secure step sends four a node): a
    # light run of 1,000 nodes, or a secure one of 100, gets one actor per core
    light = {"algorithm": "private-fedrep", "rounds": 2, "accountant": "rdp",
             "users-per-node": 20}
    assert client_actors(parse_config({**light, "num-users": 2000}), nodes=100) == 1
    assert client_actors(parse_config({**light, "num-users": 20000}), nodes=1000) == 4
    secure = parse_config({**light, "num-users": 2000, "aggregation": "secure"})
    assert client_actors(secure, nodes=100) == 4
    assert client_actors(secure, nodes=10) == 1

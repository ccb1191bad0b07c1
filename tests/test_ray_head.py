"""The Ray head a Flower run starts beside its checks (fedpriv.ray_head, launcher.early_ray_head):
when one is started, how its process group is stopped, and what a run does when it died."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpriv import launcher
from fedpriv.configure import parse_config
from fedpriv.ray_head import READY_LINE, RayHead, group_running, stop_group


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_group_of_zombies_is_not_running_though_it_still_has_members():
    """Zombies hold nothing: a stopped group is done when only zombies are left (their reaper,
    the init process under some containers, takes seconds)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    deadline = time.monotonic() + 30
    while _state(proc.pid) != "Z":  # exited, not reaped: a zombie of group proc.pid
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, 0)  # the group still has a member: the old check would wait on it
    assert not group_running(proc.pid)
    proc.wait()
    assert not group_running(proc.pid)


def test_stop_group_stops_every_live_process_of_the_group_at_once_without_grace():
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    assert group_running(leader.pid)
    stop_group(leader, grace=0)
    assert not group_running(leader.pid) and leader.returncode == -9  # SIGKILL, no SIGTERM


@pytest.fixture
def heads(monkeypatch, tmp_path):
    """Heads that ``early_ray_head`` would start, recorded instead of started; a run folder."""
    started = []

    class Recorded:
        def __init__(self, folder, num_cpus, env):
            started.append((folder, num_cpus, env))

    monkeypatch.setattr(launcher, "RayHead", Recorded)
    monkeypatch.setattr(launcher, "run_folder", lambda: str(tmp_path))
    monkeypatch.delenv(launcher.LOCAL_SUPERLINK_PORT_ENV, raising=False)
    return started


def test_a_flower_run_starts_its_own_ray_head_in_its_run_folder(heads, tmp_path):
    config = parse_config({"num-users": 200})
    assert launcher.early_ray_head(config, keep_superlink=False, ray_address=None) is not None
    (folder, num_cpus, env), = heads
    assert folder == str(tmp_path) and num_cpus == (os.cpu_count() or 1)
    assert env[launcher.RAY_PRESTART_ENV] == "0"  # the actors' environment (actor_env)
    timeouts = parse_config({"num-users": 200, "node-fault-kind": "timeout",
                             "node-fault-rate": 0.1})
    launcher.early_ray_head(timeouts, keep_superlink=False, ray_address=None)
    assert heads[-1][1] == max(8, 2 * (os.cpu_count() or 1))  # workers for nodes that hang


def test_no_early_head_where_the_run_brings_its_own_ray(heads, monkeypatch):
    """A cluster of the user's, a SuperLink kept running (it keeps its own Ray), a SuperLink
    the user named that is running, or no run folder (not a guarded command)."""
    config = parse_config({"num-users": 200})
    assert launcher.early_ray_head(config, False, "10.0.0.1:6379") is None
    assert launcher.early_ray_head(config, True, None) is None
    monkeypatch.setenv(launcher.LOCAL_SUPERLINK_PORT_ENV, "12345")
    monkeypatch.setattr(launcher, "_port_open", lambda port: port == 12345)
    assert launcher.early_ray_head(config, False, None) is None
    monkeypatch.setattr(launcher, "_port_open", lambda port: False)  # named, not running yet
    assert launcher.early_ray_head(config, False, None) is not None
    monkeypatch.setattr(launcher, "run_folder", lambda: None)
    assert launcher.early_ray_head(config, False, None) is None
    assert len(heads) == 1


def test_a_run_whose_ray_head_died_says_why_and_lets_flower_start_its_own_ray(
        tmp_path, monkeypatch, capsys):
    class Dead:
        address = "127.0.0.1:1"

        def exited(self):
            return True

        def log_tail(self):
            return "gcs_server: port 1 is already in use"

    ran = {}

    def flwr_run(*args, **kwargs):
        ran.update(kwargs)
        return 0

    monkeypatch.setattr(launcher, "_flwr_run", flwr_run)
    monkeypatch.delenv(launcher.LOCAL_SUPERLINK_PORT_ENV, raising=False)
    config = parse_config({"num-users": 200})
    assert launcher.run_flower(config, {}, tmp_path / "r.json", False, head=Dead()) == 0
    assert ran["ray_address"] is None and ran["head"] is None
    err = capsys.readouterr().err
    assert "Ray head exited; the simulation starts its own Ray" in err
    assert "port 1 is already in use" in err


def test_no_ray_command_means_no_early_head(heads, monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("ray")

    monkeypatch.setattr(launcher, "RayHead", missing)
    assert launcher.early_ray_head(parse_config({"num-users": 200}), False, None) is None


def _head_of(proc, log: Path) -> RayHead:
    head = RayHead.__new__(RayHead)
    head.folder, head.log_path, head.proc = str(log.parent), log, proc
    return head


def test_a_head_that_never_comes_up_stops_the_run_and_a_ready_one_does_not(tmp_path, capsys):
    log = tmp_path / "ray-head.log"
    log.write_text("starting...\n")
    hung = _head_of(subprocess.Popen(["sleep", "30"], start_new_session=True), log)
    failed = []
    hung.watch(0.3, lambda: failed.append(True)).join(10)
    assert failed == [True]
    assert "was not up after 0.3 s; stopping the run" in capsys.readouterr().err
    hung.stop()
    log.write_text(f"{READY_LINE}.\n")
    ready = _head_of(subprocess.Popen(["sleep", "30"], start_new_session=True), log)
    ready.watch(0.3, lambda: failed.append(False)).join(10)
    assert failed == [True]
    ready.stop()
    assert not group_running(ready.proc.pid)


def test_the_early_head_is_stopped_when_the_config_fails_its_checks(monkeypatch, tmp_path):
    """A plan no noise level meets fails after the head started: the head is stopped."""
    from fedpriv import cli, run_command

    stopped = []

    class Head:
        def stop(self):
            stopped.append(True)

    monkeypatch.setattr(run_command, "early_ray_head", lambda *a: Head())
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--set", "epsilon=50000", "--out", str(tmp_path / "r.json")]) == 2
    assert stopped == [True]


def test_a_driver_keeps_a_loopback_address_and_leaves_a_cluster_address_alone():
    from fedpriv.ray_head import RAY_LOOPBACK_ENV, driver_env

    assert driver_env("127.0.0.1:6379") == {"RAY_ADDRESS": "127.0.0.1:6379",
                                            RAY_LOOPBACK_ENV: "0"}
    assert driver_env("10.0.0.5:6379") == {"RAY_ADDRESS": "10.0.0.5:6379"}

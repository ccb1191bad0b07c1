"""Faults and a killed server, through the real Flower runtime (simulation engine, Ray)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedpriv import checkpoint
from fedpriv.configure import parse_config
from fedpriv.engine import run_in_process
from fedpriv.stopping import process_tree
from tests.test_flower_integration import run_cli

pytestmark = pytest.mark.integration

SETTINGS = dict(num_users=600, dim=10, epsilon=2.0, rounds=5, users_per_node=200)
# a torch body on real data with adaptive clipping: its clip norm is server state to resume;
# with a learning curve (eval steps before round 1 and after rounds 2 and 4: the kill comes
# after round 2)
DEEP = dict(algorithm="deep-private-fedrep", dataset="digits", num_users=60, hidden_sizes="16",
            epsilon=2.0, delta=1e-5, rounds=5, users_per_node=20, clip_quantile=0.5,
            eval_every=2)


def _process_groups(pids: set[int]) -> set[int]:
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    return groups


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stop_groups(groups: set[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(2.0)


@pytest.mark.parametrize("settings", [SETTINGS, DEEP], ids=["private-fedrep", "deep"])
def test_killing_the_server_mid_run_and_resuming_counts_every_release_once(tmp_path,
                                                                           flower_env,
                                                                           settings):
    """The ServerApp process (flwr-simulation) is SIGKILLed after it checkpointed step 3;
    `fedpriv run --resume` continues through Flower, and the final ledger and metrics equal
    those of an uninterrupted run of the same config."""
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "fedpriv.cli", "run", "--out", str(out)]
    for key, value in settings.items():
        cmd += ["--set", f"{key.replace('_', '-')}={value}"]
    env = {**flower_env, checkpoint.PAUSE_ENV: "3"}  # hold the server after step 3
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                             start_new_session=True)
    ckpt = tmp_path / "results.checkpoint"
    groups: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        state = None
        while time.monotonic() < deadline and first.poll() is None:
            if ckpt.exists():
                state = checkpoint.load(ckpt)
                if state["completed"] == 3:
                    break
            time.sleep(0.5)
        assert state is not None and state["completed"] == 3, (tmp_path / "first.log").read_text()
        server_pid = state["pid"]
        assert "flwr-simulation" in Path(f"/proc/{server_pid}/cmdline").read_text()
        groups = _process_groups(process_tree(first.pid))
        os.kill(server_pid, signal.SIGKILL)  # the crash
        time.sleep(1.0)
        assert not _alive(server_pid)
    finally:
        # what the crash left behind: the waiting CLI, `flwr run`, the SuperLink, Ray helpers
        _stop_groups(groups | {first.pid})
        first.wait(timeout=30)
        log.close()
    assert not out.exists()
    assert checkpoint.load(ckpt)["completed"] == 3

    # starting again without --resume is refused: the checkpoint records spent budget
    refused = subprocess.run(cmd, env=flower_env, capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
    assert refused.returncode == 2 and "--resume" in refused.stderr

    resumed = subprocess.run([*cmd, "--resume"], env=flower_env, capture_output=True,
                             text=True, timeout=480, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    results = json.loads(out.read_text())
    assert results["runtime"] == "flower" and results["resumed_from_step"] == 3
    assert not ckpt.exists()  # the results are the record now

    whole = run_in_process(parse_config(
        {k.replace("_", "-"): v for k, v in settings.items()}), num_partitions=3,
        log=lambda _: None)
    assert results["privacy"]["ledger"] == whole["privacy"]["ledger"]
    assert [e["release"] for e in results["privacy"]["ledger"]] == (
        ["init"] if settings is SETTINGS else []) + [f"round-{t}" for t in range(1, 6)]
    assert results["privacy"]["epsilon"] == whole["privacy"]["epsilon"] <= 2.0
    assert results["metrics"] == pytest.approx(whole["metrics"], rel=1e-9)
    if settings is DEEP:  # the resumed server went on from the checkpointed clip norm
        clips = [r["clip_norm"] for r in results["rounds"] if r["step"].startswith("round")]
        assert clips == [r["clip_norm"] for r in whole["rounds"] if "clip_norm" in r]
        assert len(set(clips)) == 5
        evals = [{k: r[k] for k in ("step", "accuracy", "test_loss")}
                 for r in results["rounds"] if r["step"].startswith("eval-")]
        assert evals == [{k: r[k] for k in ("step", "accuracy", "test_loss")}
                         for r in whole["rounds"] if r["step"].startswith("eval-")]
        assert [e["step"] for e in evals] == ["eval-0", "eval-2", "eval-4"]
    for group in groups:  # nothing of the killed run is left
        assert not any(_alive(pid) for pid in process_tree(1) if _pgid(pid) == group)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_nodes_that_time_out_each_round_do_not_stop_the_run(tmp_path, flower_env):
    """One SuperNode in three answers only after node-timeout in every step: each step goes on
    with the others, the failure is recorded, and the privacy spent is unchanged."""
    settings = dict(SETTINGS, rounds=1, node_fault_rate=0.34, node_fault_kind="timeout",
                    node_timeout=8.0)  # init, one round and the final step: 3 timeouts
    results, proc = run_cli(flower_env, tmp_path, **settings)
    assert results["runtime"] == "flower" and results["num_nodes"] == 3
    assert [r["step"] for r in results["rounds"]] == ["init", "round-1", "final"]
    for report in results["rounds"]:
        assert report["nodes_answered"] == 2 and report["rejected"] == {"timeout": 1}
    assert results["rejections"] == {"timeout": len(results["rounds"])}
    assert "rejected=timeout:1" in proc.stdout
    clean = run_in_process(parse_config(
        {k.replace("_", "-"): v for k, v in SETTINGS.items() if k != "rounds"} | {"rounds": 1}),
        num_partitions=3, log=lambda _: None)
    assert results["privacy"]["epsilon"] == clean["privacy"]["epsilon"]
    assert [e["noise_std"] for e in results["privacy"]["ledger"]] == [
        e["noise_std"] for e in clean["privacy"]["ledger"]]

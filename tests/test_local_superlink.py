"""The local SuperLink fedpriv starts for a run (``fedpriv.local_superlink``): a SuperLink that
exits or never answers is reported with the end of its log, and one that never answers is
stopped. (A SuperLink slower than `flwr run`'s 15 s is run for real in test_first_hour.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fedpriv.local_superlink import healthy, port_open, start_local_superlink
from fedpriv.ray_head import free_port


def fake_superlink(folder: Path, script: str) -> dict[str, str]:
    """An environment whose ``flower-superlink`` is ``script`` (sh), FLWR_HOME in ``folder``."""
    scripts = folder / "bin"
    scripts.mkdir()
    tool = scripts / "flower-superlink"
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)
    return {"PATH": f"{scripts}:/usr/bin:/bin", "FLWR_HOME": str(folder / "home")}


def test_a_superlink_that_exits_is_reported_with_its_log(tmp_path):
    env = fake_superlink(tmp_path, "echo 'Port 1 is already in use' >&2\nexit 3\n")
    with pytest.raises(RuntimeError, match=r"exited with code 3(.|\n)*Port 1 is already in use"):
        start_local_superlink(free_port(), free_port(), env, str(tmp_path))
    log = tmp_path / "home" / "local-superlink" / "superlink.log"
    assert "already in use" in log.read_text()  # where Flower keeps a local SuperLink's log


def test_a_superlink_that_never_answers_is_stopped_after_the_limit(tmp_path):
    pid_file = tmp_path / "pid"
    env = fake_superlink(tmp_path, f"echo $$ > {pid_file}\necho starting\nexec sleep 600\n")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not answer within 1 s(.|\n)*starting"):
        start_local_superlink(free_port(), None, env, str(tmp_path), timeout=1.0)
    assert time.monotonic() - began < 30
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped


def test_a_missing_command_names_the_install_step(tmp_path):
    env = {"PATH": str(tmp_path), "FLWR_HOME": str(tmp_path / "home")}
    with pytest.raises(RuntimeError, match=r"flower-superlink(.|\n)*pip install -e \."):
        start_local_superlink(free_port(), None, env, str(tmp_path))


def test_a_port_without_a_superlink_is_not_healthy():
    port = free_port()
    assert not port_open(port) and not healthy(port)

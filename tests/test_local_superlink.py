"""The local SuperLink fedpriv starts for a run (``fedpriv.local_superlink``): a SuperLink that
exits or never answers is reported with the end of its log, and one that never answers is
stopped. (A SuperLink slower than `flwr run`'s 15 s is run for real in test_first_hour.)"""

from __future__ import annotations

import http.server
import os
import threading
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
    env = fake_superlink(tmp_path, f"echo starting\necho $$ > {pid_file}\nexec sleep 600\n")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not answer within 5 s(.|\n)*starting"):
        start_local_superlink(free_port(), None, env, str(tmp_path), timeout=5.0)
    assert time.monotonic() - began < 30
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped


class Health(http.server.BaseHTTPRequestHandler):
    """Answers ``GET /health`` with ``code``."""

    code = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.code if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server():
    servers = []

    def serve(code: int) -> int:
        handler = type("Handler", (Health,), {"code": code})
        server = http.server.HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return int(server.server_address[1])

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def test_only_a_success_on_the_health_path_is_healthy(health_server):
    assert healthy(health_server(200)) and healthy(health_server(204))
    assert not healthy(health_server(500)) and not healthy(health_server(404))
    port = free_port()
    assert not port_open(port) and not healthy(port)


def test_another_superlink_answering_on_the_port_is_not_taken_for_ours(tmp_path, health_server):
    """Ours exits (the port is taken) while another process answers there: an error, not a
    run submitted to (and then stopped with) a SuperLink that is not the run's."""
    port = health_server(200)
    env = fake_superlink(tmp_path, "echo 'address already in use'\nexit 1\n")
    with pytest.raises(RuntimeError, match=r"exited with code 1(.|\n)*already in use"):
        start_local_superlink(port, None, env, str(tmp_path))


def test_a_relative_flwr_home_is_the_superlinks_folders_and_the_log_is_appended_to(tmp_path):
    """FLWR_HOME relative to the SuperLink's folder, as Flower resolves it; an earlier log is
    kept, and the error quotes only this start's lines."""
    env = {**fake_superlink(tmp_path, "echo second start\nexit 2\n"), "FLWR_HOME": "rel"}
    log = tmp_path / "work" / "rel" / "local-superlink" / "superlink.log"
    log.parent.mkdir(parents=True)
    log.write_text("an earlier run's line\n")
    with pytest.raises(RuntimeError) as raised:
        start_local_superlink(free_port(), None, env, str(tmp_path / "work"))
    assert "second start" in str(raised.value) and "earlier" not in str(raised.value)
    assert log.read_text().startswith("an earlier run's line\n")


def test_a_superlink_of_fedprivs_own_is_given_to_flwr_run_by_its_address(tmp_path):
    """A connection with the SuperLink's address in its private FLWR_HOME (Flower never starts
    a second one for it); none for a SuperLink the user named (the user's config is theirs)."""
    import tomllib

    from fedpriv.launcher import CONNECTION, LocalSuperLink

    own = LocalSuperLink(41234, 41235, str(tmp_path), named=False)
    assert own.connection() == [CONNECTION]
    config = tomllib.loads((tmp_path / "config.toml").read_text())["superlink"]
    assert config[CONNECTION] == {"address": "127.0.0.1:41234", "insecure": True}
    assert config["default"] == "local" and config["local"]["address"] == ":local:"
    assert LocalSuperLink(41234, None, None, named=True).connection() == []


def test_a_missing_command_names_the_install_step(tmp_path):
    env = {"PATH": str(tmp_path), "FLWR_HOME": str(tmp_path / "home")}
    with pytest.raises(RuntimeError, match=r"flower-superlink(.|\n)*pip install -e \."):
        start_local_superlink(free_port(), None, env, str(tmp_path))


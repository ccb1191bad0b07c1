"""Deployment: docker-compose, plain processes with TLS and SuperNode authentication, Ray.

The compose files and the process commands of the integration tests both come from
``fedpriv.deploy``; the static tests check the committed compose files against it (and with
``docker-compose config`` where Debian's docker-compose is installed, as in CI), the integration
tests start real ``flower-superlink`` / ``flower-supernode`` processes on 127.0.0.1 and a real
Ray head, and stop every process they started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedpriv import deploy as dep
from fedpriv.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
# A small Private FedRep job (runs in well under a minute on 2 cores).
SETTINGS = {"num-users": 600, "dim": 10, "rounds": 1, "epsilon": 2.0, "seed": 5}


# -- static checks of the compose files ---------------------------------------------------------
def _compose(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def test_committed_compose_files_are_the_rendering_of_the_deployment_module():
    """The "cannot drift" guarantee: the compose files are generated from the functions that
    build the integration tests' process commands."""
    assert (ROOT / "docker-compose.yml").read_text() == dep.compose_yaml(), (
        "docker-compose.yml differs from its rendering: fedpriv deploy compose "
        "> docker-compose.yml")
    assert (ROOT / "docker-compose.insecure.yml").read_text() == dep.compose_yaml(
        secure=False), ("regenerate: fedpriv deploy compose --insecure > "
                        "docker-compose.insecure.yml")


def test_compose_services_run_the_process_commands_and_are_secure_by_default():
    services = _compose("docker-compose.yml")["services"]
    d = dep.Deployment()
    nodes = [f"supernode-{i}" for i in range(d.num_nodes)]
    assert set(services) == {"setup", "superlink", "register", "submit", *nodes}
    results = f"{dep.CONTAINER_RESULTS}/{dep.RESULTS_FILE}"
    assert services["superlink"]["command"] == dep.superlink_command(d)
    assert services["register"]["command"] == dep.register_command(d)
    assert services["submit"]["command"] == dep.submit_command(d, results)
    assert services["setup"]["command"] == dep.setup_command(d)
    assert services["superlink"]["healthcheck"]["test"] == ["CMD", *dep.health_command(d)]
    for i, name in enumerate(nodes):
        command = services[name]["command"]
        assert command == dep.supernode_command(d, i)
        assert command[command.index("--node-config") + 1] == (
            f"partition-id={i} num-partitions={d.num_nodes}")
        # each SuperNode sees only its own key: no other node's folder, never the CA's
        assert services[name]["volumes"] == [f"./deploy/certs/{name}:/app/certs:ro"]
        assert services[name]["depends_on"] == {
            "register": {"condition": "service_completed_successfully"}}
    # secure by default: TLS on every Flower command, SuperNode authentication on
    link = services["superlink"]["command"]
    assert "--enable-supernode-auth" in link and "--ssl-certfile" in link
    for name, spec in services.items():
        assert "--insecure" not in spec["command"], name
        assert not any(v.startswith("./deploy/certs/ca") for v in spec.get("volumes", [])), name
    assert services["register"]["command"][-d.num_nodes:] == [  # every node is registered
        f"/app/certs/supernode-{i}.pub" for i in range(d.num_nodes)]
    # the results land in ./deploy/results: mounted where the ServerApp writes them (the
    # SuperLink), readable by `submit`, which checks that this run wrote them
    assert "./deploy/results:/app/results" in services["superlink"]["volumes"]
    assert "./deploy/results:/app/results:ro" in services["submit"]["volumes"]
    assert services["superlink"]["ports"] == ["127.0.0.1:9093:9093"]  # not on every interface


def test_insecure_compose_file_is_opt_in_and_says_so():
    text = (ROOT / "docker-compose.insecure.yml").read_text()
    assert "INSECURE: NO TLS AND NO SUPERNODE AUTHENTICATION" in text.splitlines()[4]
    services = yaml.safe_load(text)["services"]
    assert "register" not in services
    flower = [s["command"] for s in services.values() if s["command"][0].startswith("flower")]
    assert len(flower) == 4 and all("--insecure" in c for c in flower)
    assert "INSECURE" not in (ROOT / "docker-compose.yml").read_text()


def test_compose_images_build_from_files_that_exist():
    from importlib.metadata import version

    dockerfiles = set()
    for name in ("docker-compose.yml", "docker-compose.insecure.yml"):
        for service, spec in _compose(name)["services"].items():
            build = spec["build"]
            context = ROOT / build["context"]
            assert context.is_dir() and (context / build["dockerfile"]).is_file(), service
            assert spec["image"] == dep.IMAGE
            dockerfiles.add(context / build["dockerfile"])
    (dockerfile,) = dockerfiles
    text = dockerfile.read_text()
    flwr_version = version("flwr")
    assert f"ARG FLWR_VERSION={flwr_version}" in text
    assert re.search(r"^FROM flwr/supernode:\$\{FLWR_VERSION\}-py3\.11-", text, re.M)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"flwr[simulation]=={flwr_version}"' in pyproject  # what the Dockerfile's sed edits
    for line in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M):
        for source in line.split():
            assert (ROOT / source).exists(), source
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"deploy/certs", "deploy/results", "results", ".git"} <= set(ignored)  # no keys
    assert {"deploy/certs/", "deploy/results/"} <= set((ROOT / ".gitignore").read_text().split())
    assert os.access(ROOT / "deploy" / "generate-certs.sh", os.X_OK)
    # the services run `fedpriv deploy ...`: the image installs the script and checks it runs
    assert "&& fedpriv deploy --help > /dev/null" in text
    assert 'CMD ["fedpriv", "deploy", "--help"]' in text


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.insecure.yml"])
def test_every_fedpriv_command_of_the_compose_files_parses(name):
    """The `fedpriv deploy ...` commands the containers run are valid for today's parser."""
    parser = build_parser()
    commands = [spec["command"] for spec in _compose(name)["services"].values()]
    commands.append(_compose(name)["services"]["superlink"]["healthcheck"]["test"][1:])
    ours = [c for c in commands if c[0] == "fedpriv"]
    # setup, health, submit; register in the secure file
    assert len(ours) == (4 if name == "docker-compose.yml" else 3)
    for command in ours:
        assert command[1] == "deploy"
        args = parser.parse_args(command[1:])
        assert args.deploy_command == command[2] and callable(args.func)


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.insecure.yml"])
def test_docker_compose_validates_the_files(name):
    """``docker-compose config`` (Debian's docker-compose, no engine needed; .ci/run installs
    it): the files are valid compose files, their conditions and options known to compose."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose not installed (apt-get install docker-compose); the YAML "
                    "checks above still ran")
    proc = subprocess.run([exe, "-f", name, "config"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)["services"]
    assert resolved["superlink"]["command"] == _compose(name)["services"]["superlink"]["command"]


# -- certificates, keys, Flower's config.toml ---------------------------------------------------
def test_certificates_and_keys_are_what_flower_expects(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import (
        load_ssh_private_key,
        load_ssh_public_key,
    )

    root = dep.generate_certs(tmp_path / "certs", 2, log=lambda _: None)
    ca = x509.load_pem_x509_certificate((root / "ca" / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((root / "superlink" / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"superlink", "localhost"}
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    for i in range(2):
        node = root / f"supernode-{i}"
        key = load_ssh_private_key((node / "supernode.key").read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        pub = load_ssh_public_key((root / "public" / f"supernode-{i}.pub").read_bytes())
        assert pub == key.public_key()
        assert stat.S_IMODE((node / "supernode.key").stat().st_mode) == 0o600
        assert sorted(p.name for p in node.iterdir()) == ["ca.crt", "supernode.key",
                                                         "supernode.pub"]
    assert sorted(p.name for p in (root / "superlink").iterdir()) == [
        "ca.crt", "server.key", "server.pem"]
    assert stat.S_IMODE((root / "ca").stat().st_mode) == 0o700
    # a second run keeps everything (compose's setup runs at every `up`); a third node is added
    before = (root / "supernode-0" / "supernode.key").read_bytes()
    dep.generate_certs(root, 3, log=lambda _: None)
    assert (root / "supernode-0" / "supernode.key").read_bytes() == before
    assert (root / "public" / "supernode-2.pub").is_file()
    # a name added later gets the SuperLink a new certificate, signed by the same CA
    dep.generate_certs(root, 3, hosts=(*dep.DEFAULT_HOSTS, "link.example.org"),
                       log=lambda _: None)
    server = x509.load_pem_x509_certificate((root / "superlink" / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    assert "link.example.org" in dep.cert_hosts(root / "superlink" / "server.pem")
    assert (root / "supernode-0" / "supernode.key").read_bytes() == before


def test_the_connection_is_added_to_an_existing_flower_config(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\n'
                      'address = ":local:"\n')
    table = dep.connection_toml("127.0.0.1:9093", "/x/ca.crt")
    dep.write_connection(table, tmp_path)
    dep.write_connection(dep.connection_toml("127.0.0.1:9999", None), tmp_path)  # replaces
    parsed = tomllib.loads(config.read_text())["superlink"]
    assert parsed["default"] == "local" and parsed["local"] == {"address": ":local:"}
    assert parsed[dep.CONNECTION] == {"address": "127.0.0.1:9999", "insecure": True}
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.toml").write_text(f'[superlink.{dep.CONNECTION}]\naddress = "a:1"\n')
    with pytest.raises(ValueError, match="already defines"):
        dep.write_connection(table, other)
    # the block that `python -m fedpriv.deployment` (before `fedpriv deploy`) wrote is replaced
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n'
        "# >>> fedpriv deployment connection (python -m fedpriv.deployment) >>>\n"
        f'[superlink.{dep.CONNECTION}]\naddress = "a:1"\ninsecure = true\n'
        "# <<< fedpriv deployment connection <<<\n")
    dep.write_connection(table, legacy)
    parsed = tomllib.loads((legacy / "config.toml").read_text())["superlink"]
    assert parsed == {"default": "local", dep.CONNECTION: {"address": "127.0.0.1:9093",
                                                          "root-certificates": "/x/ca.crt"}}


def test_submit_refuses_a_relative_results_path_and_a_bad_config(tmp_path):
    base = _python([*dep.DEPLOY_COMMAND, "submit", "--superlink", "127.0.0.1:1", "--insecure",
                    "--app", str(ROOT)])
    env = {**os.environ, "FLWR_HOME": str(tmp_path)}
    proc = subprocess.run(base + ["--results", "results.json"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode != 0 and "absolute" in proc.stderr
    proc = subprocess.run(base + ["--results", str(tmp_path / "r.json"), "--set", "epsilon=0"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "epsilon" in proc.stderr and "flwr run" not in proc.stdout


def test_printed_process_commands_are_the_module_commands(tmp_path, capsys):
    import shlex

    assert main(["deploy", "commands", "--certs", str(tmp_path), "--nodes", "2", "--app",
                 str(ROOT), "--results", str(tmp_path / "r.json")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    d = dep.Deployment(num_nodes=2, superlink_host="127.0.0.1", bind_host="127.0.0.1",
                       node_ports=(9094, 9095), certs=str(tmp_path.resolve()), mounted=False,
                       app_dir=str(ROOT))
    assert lines == [shlex.join(c) for c in (
        dep.superlink_command(d), dep.register_command(d), dep.supernode_command(d, 0),
        dep.supernode_command(d, 1), dep.submit_command(d, str(tmp_path / "r.json")))]


def test_node_data_names_each_supernodes_own_file_in_its_node_config(capsys):
    """`--node-data` gives each SuperNode its own data file, as Flower parses node configs."""
    import shlex

    from flwr.common.config import parse_config_args

    assert main(["deploy", "commands", "--insecure", "--nodes", "2", "--app", str(ROOT),
                 "--node-data", "/data/my users/node-{partition}.parquet"]) == 0
    nodes = [shlex.split(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith("flower-supernode")]
    configs = [parse_config_args([argv[argv.index("--node-config") + 1]]) for argv in nodes]
    assert configs == [{"partition-id": i, "num-partitions": 2,
                        "data-file": f"/data/my users/node-{i}.parquet"} for i in range(2)]


def test_deploy_help_lists_its_sub_commands(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0 and "deploy" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["deploy", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for command in ("certs", "compose", "commands", "health", "register", "submit", "setup"):
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), (command, out)
    with pytest.raises(SystemExit) as exited:
        main(["deploy"])  # a sub-command is required
    assert exited.value.code == 2


def test_deploy_compose_prints_the_rendering(capsys):
    assert main(["deploy", "compose", "--nodes", "2", "--insecure"]) == 0
    assert capsys.readouterr().out == dep.compose_yaml(2, secure=False)
    assert main(["deploy", "compose", "--set", "epsilon=2.0", "--set", "rounds=10"]) == 0
    out = capsys.readouterr().out
    assert out == dep.compose_yaml(settings={"epsilon": 2.0, "rounds": 10})
    assert "`fedpriv deploy compose --set epsilon=2.0 --set rounds=10`" in out.splitlines()[0]
    # a bad value is one line on stderr and exit 2, not a traceback
    assert main(["deploy", "compose", "--set", "epsilon"]) == 2
    assert "--set expects key=value" in capsys.readouterr().err


def test_ray_address_needs_the_flower_engine():
    assert main(["run", "--engine", "inprocess", "--ray-address", "127.0.0.1:1"]) == 2


# -- real processes -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python(argv: list[str]) -> list[str]:
    """A ``fedpriv ...`` command, run by this test's interpreter (and so this checkout's
    fedpriv, whatever ``fedpriv`` script is on the PATH)."""
    return [sys.executable, "-m", "fedpriv.cli", *argv[1:]] if argv[0] == "fedpriv" else argv


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def _marked(marker: bytes) -> set[int]:
    """Processes whose environment holds ``marker`` (our private FLWR_HOME): ours by birth."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    found.add(int(entry))
            except OSError:
                continue
    return found


class Processes:
    """The processes a test started; ``stop`` ends them, and everything they spawned, by PID."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.started: dict[str, subprocess.Popen] = {}
        self.marker = f"FLWR_HOME={env['FLWR_HOME']}".encode()

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("w") as log:
            proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.logs,
                                    start_new_session=True)
        self.started[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def tails(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.log(name)[-1500:]}" for name in self.started)

    def _ours(self) -> set[int]:
        tree, pids = _children(), set()
        todo = [p.pid for p in self.started.values()] + sorted(_marked(self.marker))
        while todo:
            pid = todo.pop()
            if pid not in pids:
                pids.add(pid)
                todo.extend(tree.get(pid, []))
        return pids

    def stop(self, grace: float = 15.0) -> list[int]:
        """SIGTERM, then SIGKILL after ``grace`` seconds; returns the PIDs still alive."""
        pids = self._ours()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in self._ours() | pids):
            for proc in self.started.values():
                proc.poll()  # reap our direct children
            time.sleep(0.2)
        for pid in self._ours() | pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.started.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.5)
        return [p for p in self._ours() | pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; its parent reaps it


@pytest.fixture
def processes():
    # short paths: Ray's socket paths must stay under 107 bytes
    short = Path(tempfile.mkdtemp(prefix="fpd", dir="/tmp"))
    env = dict(os.environ)
    env.update({
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "FLWR_HOME": str(short / "flwr"),
        "RAY_TMPDIR": str(short / "ray"),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
    })
    env.pop("RAY_ADDRESS", None)
    for sub in ("flwr", "ray", "logs"):
        (short / sub).mkdir()
    procs = Processes(env, short / "logs")
    procs.short = short  # type: ignore[attr-defined]
    try:
        yield procs
    finally:
        leftover = procs.stop()
        shutil.rmtree(short, ignore_errors=True)
        assert not leftover, f"processes still running after the test: {leftover}"


def _start_superlink(procs: Processes, d: dep.Deployment, ca: str | None) -> None:
    link = procs.start("superlink", dep.superlink_command(d))
    _wait(lambda: link.poll() is not None or dep.check_health(d.superlink_address, ca),
          90, "the SuperLink's /health")
    assert link.poll() is None, procs.log("superlink")


def _insecure_deployment(procs: Processes, nodes: int) -> dep.Deployment:
    """An insecure SuperLink and ``nodes`` SuperNodes on loopback, started as processes."""
    d = dep.Deployment(num_nodes=nodes, superlink_host="127.0.0.1", bind_host="127.0.0.1",
                       superlink_port=_free_port(),
                       node_ports=tuple(_free_port() for _ in range(nodes)), certs=None,
                       mounted=False, app_dir=str(ROOT))
    _start_superlink(procs, d, None)
    for i in range(d.num_nodes):
        procs.start(f"supernode-{i}", dep.supernode_command(d, i))
    return d


def _submit(procs: Processes, d: dep.Deployment, results: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(_python(dep.submit_command(d, str(results), SETTINGS)),
                          env=procs.env, cwd=procs.logs, capture_output=True, text=True,
                          timeout=420)
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-3000:] + procs.tails())
    assert "flwr run " in proc.stdout
    return proc


def _in_process(num_partitions: int) -> dict:
    from fedpriv.configure import parse_config
    from fedpriv.engine import run_in_process

    local = run_in_process(parse_config(SETTINGS), num_partitions=num_partitions,
                           log=lambda _: None)
    return json.loads(json.dumps(local, default=float))  # as the results file has it


def _matches_the_simulation(results: dict, nodes: int) -> None:
    local = _in_process(nodes)
    assert results["runtime"] == "flower" and results["num_nodes"] == nodes
    assert results["profile"]["indexed_dispatch"] is False  # a SuperLink's own state: Flower's
    assert all(r["nodes_answered"] == nodes for r in results["rounds"])
    assert results["privacy"]["ledger"] == local["privacy"]["ledger"]
    assert [e["release"] for e in results["privacy"]["ledger"]] == ["init", "round-1"]
    assert results["privacy"]["epsilon"] == pytest.approx(local["privacy"]["epsilon"])
    for key in ("population_mse", "test_mse"):
        assert results["metrics"][key] == pytest.approx(local["metrics"][key], rel=1e-9)
    assert results["metrics"]["population_mse"] < 0.2 * results["metrics"]["local_only_mse"]


@pytest.mark.integration
def test_superlink_and_supernodes_as_plain_processes_match_the_simulation(processes):
    """The insecure deployment as processes: SuperLink + 3 SuperNodes, the run submitted with
    `flwr run` through the same command the compose file's `submit` service runs."""
    d = _insecure_deployment(processes, 3)
    results = processes.short / "results" / "run.json"
    _submit(processes, d, results)
    _matches_the_simulation(json.loads(results.read_text()), nodes=3)


@pytest.mark.integration
def test_simulation_attaches_to_an_existing_ray_cluster(processes):
    """A Ray head started as a separate process on 127.0.0.1; `fedpriv run --ray-address` runs
    the simulation on it instead of starting a Ray instance of its own."""
    port = _free_port()
    head_dir = processes.short / "rh"
    head = processes.start("ray-head", [
        "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
        "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
        f"--temp-dir={head_dir}", f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}"])
    logs = head_dir / "session_latest" / "logs"
    _wait(lambda: head.poll() is not None or "Ray runtime started" in processes.log("ray-head"),
          120, "the Ray head")
    assert head.poll() is None, processes.log("ray-head")
    assert "Local node IP: 127.0.0.1" in processes.log("ray-head")  # loopback only

    out = processes.short / "results" / "ray.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fedpriv.cli", "run", "--out", str(out), "--ray-address",
         f"127.0.0.1:{port}", *[f"--set={k}={v}" for k, v in SETTINGS.items()],
         "--set=users-per-node=200"],
        env=processes.env, cwd=processes.short, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + processes.tails()
    results = json.loads(out.read_text())
    assert results["runtime"] == "flower" and results["num_nodes"] == 3
    assert results["privacy"]["ledger"] == _in_process(3)["privacy"]["ledger"]
    # observable, not assumed: the driver and the ClientApp actors ran in the head's cluster ...
    assert list(logs.glob("python-core-driver-*.log")), sorted(p.name for p in logs.iterdir())
    actors = [p for p in logs.glob("worker-*.out") if ":actor_name:ClientAppActor" in
              p.read_text(errors="replace")]
    assert actors, sorted(p.name for p in logs.iterdir())
    # ... and the simulation started no Ray instance of its own
    assert not list(Path(processes.env["RAY_TMPDIR"]).rglob("session_*"))
    assert head.poll() is None  # the cluster outlives the run: it is not the simulation's


@pytest.mark.integration
def test_supernodes_read_only_their_own_users_rows_of_their_own_data_file(processes):
    """Deep Private FedRep on your own CSV table, deployed: the run config's data-file (what the
    server sees) is the header alone: the server reads no user's row; each SuperNode's node
    config names its own copy, junk in every row but its own users' (a node that parsed
    another row would isolate that user and change the result). The run equals the
    in-process run on the clean file."""
    from fedpriv.algorithms.deep.problem import hosted_positions
    from fedpriv.configure import parse_config
    from fedpriv.data.partition import user_keys
    from fedpriv.engine import run_in_process
    from tests.test_tables import KEYS, ROWS, USERS, write_csv

    data = processes.short / "data"
    data.mkdir()
    nodes = 2
    ids = np.unique([r[0] for r in ROWS])
    for i in range(nodes):
        own = set(ids[hosted_positions("natural", user_keys(ids), USERS, i, nodes)].tolist())
        write_csv(data / f"node-{i}.csv", junk=lambda k, own=own: ROWS[k][0] not in own)
    write_csv(data / "server.csv", rows=[])  # the header only
    settings = {**KEYS, "dataset": "csv", "data-file": str(data / "server.csv"),
                "users-per-node": USERS // nodes}
    settings.pop("checkpoint")
    settings["rounds"] = 1  # a deep round starts a ClientApp process (torch) on every node
    d = dep.Deployment(num_nodes=nodes, superlink_host="127.0.0.1", bind_host="127.0.0.1",
                       superlink_port=_free_port(),
                       node_ports=tuple(_free_port() for _ in range(nodes)), certs=None,
                       mounted=False, app_dir=str(ROOT),
                       node_data=str(data / "node-{partition}.csv"))
    _start_superlink(processes, d, None)
    for i in range(nodes):
        processes.start(f"supernode-{i}", dep.supernode_command(d, i))
    results = processes.short / "results" / "run.json"
    proc = subprocess.run(_python(dep.submit_command(d, str(results), settings)),
                          env=processes.env, cwd=processes.logs, capture_output=True,
                          text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + processes.tails()
    flower = json.loads(results.read_text())
    clean = {**settings, "data-file": str(write_csv(data / "clean.csv")), "checkpoint": False}
    local = run_in_process(parse_config(clean), num_partitions=nodes,
                           log=lambda _: None)
    assert flower["num_nodes"] == nodes
    assert all(r["nodes_answered"] == nodes for r in flower["rounds"])
    assert flower["metrics"]["accuracy"] == pytest.approx(local["metrics"]["accuracy"],
                                                          abs=1e-6)
    assert flower["metrics"]["accuracy"] > 0.5
    assert [e["release"] for e in flower["privacy"]["ledger"]] == ["round-1"]


@pytest.mark.integration
def test_ctrl_c_on_submit_stops_the_run_on_the_superlink(processes):
    """`fedpriv deploy submit` interrupted (Ctrl-C to its process group) while the ServerApp
    holds after step 1: the command stops the run on the SuperLink (`flwr stop`), so the
    ServerApp ends and no further step is released; one line says so, no traceback."""
    from fedpriv import checkpoint

    processes.env[checkpoint.PAUSE_ENV] = "1"  # the SuperLink's ServerApp inherits it
    d = _insecure_deployment(processes, 2)
    results = processes.short / "results" / "run.json"
    ckpt = results.with_suffix(".checkpoint")
    submit = processes.start("submit", _python(dep.submit_command(d, str(results), SETTINGS)))
    _wait(lambda: submit.poll() is not None or (
        ckpt.exists() and checkpoint.load(ckpt)["completed"] == 1), 240, "step 1")
    server = checkpoint.load(ckpt)["pid"]
    os.killpg(submit.pid, signal.SIGINT)
    assert submit.wait(timeout=90) == 128 + signal.SIGINT, processes.tails()
    text = processes.log("submit")
    assert "stopped on the SuperLink" in text and "Traceback" not in text, text[-3000:]
    _wait(lambda: not _alive(server), 60, "the ServerApp to end")
    time.sleep(2.0)
    assert checkpoint.load(ckpt)["completed"] == 1 and not results.exists()

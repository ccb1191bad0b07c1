"""The process commands of a real Flower deployment of the fedpriv app, from one place.

A deployment is one SuperLink, N SuperNodes (node ``i`` hosts partition ``i`` of ``N`` through its
node config), the registration of the SuperNodes' public keys (SuperNode authentication) and the
submission of a run with ``flwr run``. This module builds the argv of each of these processes, the
``[superlink.<name>]`` connection of Flower's ``config.toml``, and checks the SuperLink's health.
The integration tests start these commands as plain processes on 127.0.0.1, and the compose file
(``fedpriv.deploy.compose``) runs the same commands in containers, so the two cannot drift apart.

Flower 1.41 facts this relies on: the SuperLink serves its Fleet, Control and Runtime APIs over
HTTP(S) on one ``--host``/``--port``; a SuperNode's own Runtime API (for its ClientApp
subprocess) takes ``--host``/``--port`` (``--clientappio-api-address`` is gone); TLS is
``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile`` on the SuperLink and ``--root-certificates``
elsewhere; with ``--enable-supernode-auth`` only SuperNodes whose public key was registered with
``flwr supernode register KEY.pub CONNECTION`` can activate (the others exit with "Failed to
activate SuperNode"); the ``flwr`` CLI finds the SuperLink through a named connection in
``$FLWR_HOME/config.toml``.
"""

from __future__ import annotations

import http.client
import os
import re
import ssl
import tomllib
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpriv.config_files import toml_error, toml_value

DEPLOY_COMMAND = ("fedpriv", "deploy")
"""How a deployment process runs one of ``fedpriv deploy``'s sub-commands (the project's script,
installed by ``pip install``, also in the image of deploy/Dockerfile)."""
CONNECTION = "fedpriv-deploy"
"""Name of the SuperLink connection in ``$FLWR_HOME/config.toml``."""
SUPERLINK_PORT = 9093
"""The SuperLink's one HTTP(S) port (Fleet, Control and Runtime APIs)."""
NODE_PORT = 9094
"""A SuperNode's Runtime API port (Flower's default); nodes on one host need distinct ports."""
CONTAINER_CERTS = "/app/certs"
CONTAINER_APP = "/app/project"
CONTAINER_RESULTS = "/app/results"
RESULTS_FILE = "run.operator.json"
APP_OWNER = "49999:49999"
"""uid:gid of the ``app`` user in Flower's official images (and so in deploy/Dockerfile)."""
IMAGE = "fedpriv-deploy:latest"
DOCKERFILE = "deploy/Dockerfile"
CERTS_DIR = "deploy/certs"
RESULTS_DIR = "deploy/results"
"""Host folder of the compose deployment's results (not ./results: the containers' user owns
it after ``setup``, and ``fedpriv run`` on the host writes to ./results)."""
DEFAULT_HOSTS = ("superlink", "localhost", "127.0.0.1", "::1")
"""Names the SuperLink's TLS certificate is valid for (subject alternative names)."""

# Files of a certificate folder made by ``generate_certs``: one subfolder per role, so that each
# container (or machine) receives only what it needs; the CA key never leaves ``ca/``.
CA_CERT = "ca.crt"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
NODE_KEY = "supernode.key"
NODE_PUB = "supernode.pub"


def node_role(i: int) -> str:
    """The certificate subfolder (and compose service name) of SuperNode ``i``."""
    return f"supernode-{i}"


@dataclass(frozen=True)
class Deployment:
    """Everything the commands of one deployment need: addresses, ports, credential paths.

    ``certs`` is the certificate folder; ``None`` means the insecure mode (no TLS, no SuperNode
    authentication). With ``mounted`` (containers), every role sees its own subfolder of
    ``certs`` at ``certs`` itself; otherwise (processes on one machine) role ``r`` reads
    ``certs/r``.
    """

    num_nodes: int = 3
    superlink_host: str = "superlink"  # how SuperNodes and the flwr CLI reach the SuperLink
    superlink_port: int = SUPERLINK_PORT
    bind_host: str = "0.0.0.0"  # where the SuperLink listens
    node_ports: tuple[int, ...] = ()  # Runtime API port of each SuperNode; () -> NODE_PORT
    certs: str | None = CONTAINER_CERTS
    mounted: bool = True
    app_dir: str = CONTAINER_APP
    connection: str = CONNECTION
    # each SuperNode's own copy of a csv/parquet data file ("{partition}" is replaced by the
    # node's partition id); "" = the nodes read the run config's data-file
    node_data: str = ""

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"a deployment needs at least one SuperNode, got {self.num_nodes}")
        if self.node_ports and len(self.node_ports) != self.num_nodes:
            raise ValueError(f"node_ports has {len(self.node_ports)} ports for "
                             f"{self.num_nodes} SuperNodes")

    @property
    def secure(self) -> bool:
        return self.certs is not None

    @property
    def superlink_address(self) -> str:
        host = f"[{self.superlink_host}]" if ":" in self.superlink_host else self.superlink_host
        return f"{host}:{self.superlink_port}"

    def cert_dir(self, role: str) -> str:
        """Folder where ``role`` ("superlink", "supernode-<i>", "public") finds its files."""
        if self.certs is None:
            raise ValueError("an insecure deployment has no certificates")
        return self.certs if self.mounted else f"{self.certs}/{role}"

    def node_port(self, i: int) -> int:
        return self.node_ports[i] if self.node_ports else NODE_PORT

    def public_key(self, i: int) -> str:
        """Path of SuperNode ``i``'s public key as the registering operator sees it."""
        return f"{self.cert_dir('public')}/{node_role(i)}.pub"


# -- Flower's processes -------------------------------------------------------------------------
def superlink_command(d: Deployment) -> list[str]:
    """``flower-superlink``: TLS and SuperNode authentication, or ``--insecure``."""
    argv = ["flower-superlink", "--host", d.bind_host, "--port", str(d.superlink_port)]
    if d.secure:
        certs = d.cert_dir("superlink")
        argv += ["--ssl-ca-certfile", f"{certs}/{CA_CERT}",
                 "--ssl-certfile", f"{certs}/{SERVER_CERT}",
                 "--ssl-keyfile", f"{certs}/{SERVER_KEY}",
                 "--enable-supernode-auth"]
    else:
        argv += ["--insecure"]
    # the app and its dependencies are installed ahead (image or `pip install -e .`)
    return argv + ["--disable-runtime-dependency-installation"]


def supernode_command(d: Deployment, partition: int, *, role: str | None = None,
                      port: int | None = None) -> list[str]:
    """``flower-supernode`` hosting ``partition`` of ``d.num_nodes``; its key is the one of
    ``role`` (default: its own, ``supernode-<partition>``)."""
    if not 0 <= partition < d.num_nodes:
        raise ValueError(f"partition {partition} outside [0, {d.num_nodes})")
    argv = ["flower-supernode", "--superlink", d.superlink_address,
            "--host", "127.0.0.1", "--port", str(port or d.node_port(partition)),
            "--node-config", node_config_string(d, partition)]
    if d.secure:
        certs = d.cert_dir(role or node_role(partition))
        argv += ["--root-certificates", f"{certs}/{CA_CERT}",
                 "--auth-supernode-private-key", f"{certs}/{NODE_KEY}"]
    else:
        argv += ["--insecure"]
    return argv


def node_config_string(d: Deployment, partition: int) -> str:
    """A SuperNode's ``--node-config``: its partition, and its own data file where given (the
    node then reads only its own users' rows of a csv/parquet table; ``clients.app``)."""
    text = f"partition-id={partition} num-partitions={d.num_nodes}"
    if d.node_data:
        text += f" data-file={toml_value(d.node_data.replace('{partition}', str(partition)))}"
    return text


def register_argv(public_key: str, connection: str = CONNECTION) -> list[str]:
    """The Flower CLI command that registers one SuperNode's public key with the SuperLink."""
    return ["flwr", "supernode", "register", public_key, connection]


def run_config_string(values: Mapping[str, Any]) -> str:
    """``key=value`` pairs for ``flwr run --run-config`` (values as TOML literals)."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())


def submit_argv(app_dir: str, run_config: Mapping[str, Any],
                connection: str = CONNECTION) -> list[str]:
    """``flwr run``: build the app's FAB and start a run on the SuperLink; stream its logs."""
    argv = ["flwr", "run", app_dir, connection]
    if run_config:
        argv += ["--run-config", run_config_string(run_config)]
    return argv + ["--stream"]


# -- fedpriv's own steps (``fedpriv deploy ...``) ------------------------------------------------
def _connection_args(d: Deployment) -> list[str]:
    tls = (["--root-certificates", f"{d.cert_dir('public')}/{CA_CERT}"] if d.secure
           else ["--insecure"])
    return ["--superlink", d.superlink_address, *tls, "--connection", d.connection]


def register_command(d: Deployment, nodes: Iterable[int] | None = None) -> list[str]:
    """Register the public keys of ``nodes`` (default: all) through ``flwr supernode register``."""
    if not d.secure:
        raise ValueError("an insecure SuperLink has no SuperNode authentication to register for")
    keys = [d.public_key(i) for i in (range(d.num_nodes) if nodes is None else nodes)]
    return [*DEPLOY_COMMAND, "register", *_connection_args(d), *keys]


def submit_command(d: Deployment, results: str, settings: Mapping[str, Any] | None = None,
                   config: str | None = None) -> list[str]:
    """Submit the run (``flwr run``), wait for it, and check that ``results`` was written."""
    argv = [*DEPLOY_COMMAND, "submit", *_connection_args(d), "--app", d.app_dir,
            "--results", results]
    if config:
        argv += ["--config", config]
    for key, value in (settings or {}).items():
        argv += ["--set", f"{key}={toml_value(value)}"]
    return argv


def health_command(d: Deployment, role: str = "superlink") -> list[str]:
    """Exit 0 once the SuperLink answers its ``/health`` endpoint (over TLS when secure)."""
    tls = (["--root-certificates", f"{d.cert_dir(role)}/{CA_CERT}"] if d.secure
           else ["--insecure"])
    return [*DEPLOY_COMMAND, "health", "--superlink", f"127.0.0.1:{d.superlink_port}", *tls]


def setup_command(d: Deployment, results_dir: str = CONTAINER_RESULTS,
                  owner: str = APP_OWNER) -> list[str]:
    """One-shot: generate the certificates and keys (secure mode) and hand the certificate and
    results folders to the containers' ``app`` user."""
    argv = [*DEPLOY_COMMAND, "setup", "--results", results_dir, "--owner", owner]
    if d.certs is not None:
        argv += ["--certs", d.certs, "--nodes", str(d.num_nodes)]
    return argv


# -- Flower's config.toml -----------------------------------------------------------------------
_BEGIN = "# >>> fedpriv deployment connection (fedpriv deploy) >>>"
_END = "# <<< fedpriv deployment connection <<<"
_OLD_BEGIN = "# >>> fedpriv deployment connection (python -m fedpriv.deployment) >>>"
"""The marker earlier versions wrote; their block is replaced too."""


def connection_toml(superlink_address: str, root_certificates: str | None,
                    connection: str = CONNECTION) -> str:
    """The ``[superlink.<connection>]`` table of Flower's ``config.toml``."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", connection):
        raise ValueError(f"connection name {connection!r}: use letters, digits, '-' and '_'")
    lines = [f"[superlink.{connection}]", f"address = {toml_value(superlink_address)}"]
    if root_certificates is None:
        lines.append("insecure = true")
    else:
        lines.append(f"root-certificates = {toml_value(root_certificates)}")
    return "\n".join(lines) + "\n"


def flwr_home() -> Path:
    """``$FLWR_HOME``, or Flower's default ``~/.flwr``."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser()


def write_connection(table: str, home: Path | None = None) -> Path:
    """Add (or replace) this module's SuperLink connection in ``config.toml``; every other line
    of the file is kept."""
    path = (home or flwr_home()) / "config.toml"
    text = path.read_text() if path.is_file() else ""
    for begin in (_BEGIN, _OLD_BEGIN):
        if begin in text and _END in text.split(begin, 1)[1]:
            head, rest = text.split(begin, 1)
            text = head + rest.split(_END, 1)[1].lstrip("\n")
    name = table.split("]", 1)[0].removeprefix("[superlink.")
    try:
        existing = tomllib.loads(text).get("superlink", {})
    except tomllib.TOMLDecodeError as err:
        raise ValueError(toml_error(path, err)) from None
    if name in existing:
        raise ValueError(f"{path} already defines the SuperLink connection {name!r}; remove it "
                         "or choose another name with --connection")
    if text and not text.endswith("\n"):
        text += "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{text}{_BEGIN}\n{table}{_END}\n")
    return path


_LOOPBACK = ("127.0.0.1:", "localhost:", "[::1]:")


def check_health(address: str, root_certificates: str | None, timeout: float = 3.0) -> bool:
    """Whether the SuperLink at ``address`` answers ``GET /health`` with a success (a
    loopback address never through a proxy: none could reach this machine's)."""
    scheme = "http" if root_certificates is None else "https"
    context = None if root_certificates is None else ssl.create_default_context(
        cafile=root_certificates)
    handlers: list[urllib.request.BaseHandler] = [urllib.request.HTTPSHandler(context=context)]
    if address.startswith(_LOOPBACK):
        handlers.append(urllib.request.ProxyHandler({}))
    try:
        with urllib.request.build_opener(*handlers).open(f"{scheme}://{address}/health",
                                                         timeout=timeout) as response:
            status: int = response.status
            return 200 <= status < 300
    except (OSError, http.client.HTTPException):  # refused, TLS failure, not HTTP(S), ...
        return False

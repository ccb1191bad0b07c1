"""A real Flower deployment of the fedpriv app: its process commands, from one place.

A deployment is one SuperLink, N SuperNodes (node ``i`` hosts partition ``i`` of ``N`` through its
node config), the registration of the SuperNodes' public keys (SuperNode authentication) and the
submission of a run with ``flwr run``. This module builds the argv of each of these processes.
The integration tests start them as plain processes on 127.0.0.1, and ``docker-compose.yml`` is
rendered from the same functions, so the two cannot drift apart (a test compares the committed
file with the rendering). It never imports flwr: it only builds commands, files and certificates.

    python -m fedpriv.deployment certs DIR [--nodes N] [--host NAME ...]   TLS + SuperNode keys
    python -m fedpriv.deployment compose [--nodes N] [--insecure] [--set K=V ...]  > compose file
    python -m fedpriv.deployment commands --certs DIR [--nodes N] [--insecure]   plain processes
    python -m fedpriv.deployment health --superlink HOST:PORT (--root-certificates CA | --insecure)
    python -m fedpriv.deployment register --superlink HOST:PORT --root-certificates CA KEY.pub ...
    python -m fedpriv.deployment submit --superlink HOST:PORT (...) --app DIR --results PATH
                                        [--config TOML] [--set K=V ...]

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

import argparse
import datetime
import http.client
import ipaddress
import json
import os
import re
import shlex
import ssl
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONNECTION = "fedpriv-deploy"
"""Name of the SuperLink connection in ``$FLWR_HOME/config.toml``."""
SUPERLINK_PORT = 9093
"""The SuperLink's one HTTP(S) port (Fleet, Control and Runtime APIs)."""
NODE_PORT = 9094
"""A SuperNode's Runtime API port (Flower's default); nodes on one host need distinct ports."""
CONTAINER_CERTS = "/app/certs"
CONTAINER_APP = "/app/project"
CONTAINER_RESULTS = "/app/results"
RESULTS_FILE = "fedpriv-results.json"
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


# -- the process commands -----------------------------------------------------------------------
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
            "--node-config", f"partition-id={partition} num-partitions={d.num_nodes}"]
    if d.secure:
        certs = d.cert_dir(role or node_role(partition))
        argv += ["--root-certificates", f"{certs}/{CA_CERT}",
                 "--auth-supernode-private-key", f"{certs}/{NODE_KEY}"]
    else:
        argv += ["--insecure"]
    return argv


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


def _connection_args(d: Deployment) -> list[str]:
    tls = (["--root-certificates", f"{d.cert_dir('public')}/{CA_CERT}"] if d.secure
           else ["--insecure"])
    return ["--superlink", d.superlink_address, *tls, "--connection", d.connection]


def register_command(d: Deployment, nodes: Iterable[int] | None = None) -> list[str]:
    """Register the public keys of ``nodes`` (default: all) through ``flwr supernode register``."""
    if not d.secure:
        raise ValueError("an insecure SuperLink has no SuperNode authentication to register for")
    keys = [d.public_key(i) for i in (range(d.num_nodes) if nodes is None else nodes)]
    return ["python", "-m", "fedpriv.deployment", "register", *_connection_args(d), *keys]


def submit_command(d: Deployment, results: str, settings: Mapping[str, Any] | None = None,
                   config: str | None = None) -> list[str]:
    """Submit the run (``flwr run``), wait for it, and check that ``results`` was written."""
    argv = ["python", "-m", "fedpriv.deployment", "submit", *_connection_args(d),
            "--app", d.app_dir, "--results", results]
    if config:
        argv += ["--config", config]
    for key, value in (settings or {}).items():
        argv += ["--set", f"{key}={toml_value(value)}"]
    return argv


def health_command(d: Deployment, role: str = "superlink") -> list[str]:
    """Exit 0 once the SuperLink answers its ``/health`` endpoint (over TLS when secure)."""
    tls = (["--root-certificates", f"{d.cert_dir(role)}/{CA_CERT}"] if d.secure
           else ["--insecure"])
    return ["python", "-m", "fedpriv.deployment", "health",
            "--superlink", f"127.0.0.1:{d.superlink_port}", *tls]


def setup_command(d: Deployment, results_dir: str = CONTAINER_RESULTS,
                  owner: str = APP_OWNER) -> list[str]:
    """One-shot: generate the certificates and keys (secure mode) and hand the certificate and
    results folders to the containers' ``app`` user."""
    argv = ["python", "-m", "fedpriv.deployment", "setup", "--results", results_dir,
            "--owner", owner]
    if d.secure:
        argv += ["--certs", d.certs, "--nodes", str(d.num_nodes)]  # type: ignore[list-item]
    return argv


# -- Flower's config.toml -----------------------------------------------------------------------
_BEGIN = "# >>> fedpriv deployment connection (python -m fedpriv.deployment) >>>"
_END = "# <<< fedpriv deployment connection <<<"


def flwr_home() -> Path:
    """``$FLWR_HOME``, or Flower's default ``~/.flwr``."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser()


def write_connection(table: str, home: Path | None = None) -> Path:
    """Add (or replace) this module's SuperLink connection in ``config.toml``; every other line
    of the file is kept."""
    path = (home or flwr_home()) / "config.toml"
    text = path.read_text() if path.is_file() else ""
    if _BEGIN in text and _END in text:
        head, rest = text.split(_BEGIN, 1)
        text = head + rest.split(_END, 1)[1].lstrip("\n")
    name = table.split("]", 1)[0].removeprefix("[superlink.")
    try:
        existing = tomllib.loads(text).get("superlink", {})
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path} is not valid TOML: {err}") from None
    if name in existing:
        raise ValueError(f"{path} already defines the SuperLink connection {name!r}; remove it "
                         "or choose another name with --connection")
    if text and not text.endswith("\n"):
        text += "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{text}{_BEGIN}\n{table}{_END}\n")
    return path


# -- certificates and SuperNode keys ------------------------------------------------------------
def generate_certs(directory: str | os.PathLike, num_nodes: int,
                   hosts: Sequence[str] = DEFAULT_HOSTS, days: int = 365,
                   force: bool = False, log=print) -> Path:
    """Create (or complete) a certificate folder: a CA, the SuperLink's server certificate
    (valid for ``hosts``) and one EC key pair per SuperNode in OpenSSH format (P-384, a NIST
    curve as Flower requires). Existing files are kept unless ``force``. Layout::

        ca/ca.crt ca/ca.key                      the CA (its key is never handed out)
        superlink/ca.crt server.pem server.key   what the SuperLink needs
        supernode-<i>/ca.crt supernode.key supernode.pub   what SuperNode i needs
        public/ca.crt supernode-<i>.pub          what the operator registering nodes needs
    """
    from cryptography.hazmat.primitives import serialization  # flwr depends on cryptography

    root = Path(directory).expanduser().resolve()
    ca_dir = root / "ca"
    ca_cert_path, ca_key_path = ca_dir / CA_CERT, ca_dir / "ca.key"
    if force or not (ca_cert_path.is_file() and ca_key_path.is_file()):
        ca_key, ca_cert = _new_ca(days)
        _write(ca_key_path, _private_pem(ca_key), 0o600)
        _write(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
        force = True  # everything else must be signed by (or trust) the new CA
        log(f"fedpriv: new certificate authority in {ca_dir}")
    else:
        from cryptography import x509

        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    ca_pem = ca_cert_path.read_bytes()

    link = root / "superlink"
    if force or not all((link / f).is_file() for f in (CA_CERT, SERVER_CERT, SERVER_KEY)) or (
            not set(hosts) <= _cert_hosts(link / SERVER_CERT)):  # a name was added
        key, cert = _new_server_cert(ca_key, ca_cert, hosts, days)
        _write(link / SERVER_KEY, _private_pem(key), 0o600)
        _write(link / SERVER_CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        log(f"fedpriv: SuperLink certificate for {', '.join(hosts)} in {link}")
    _write(link / CA_CERT, ca_pem, 0o644)

    public = root / "public"
    _write(public / CA_CERT, ca_pem, 0o644)
    for i in range(num_nodes):
        node = root / node_role(i)
        if force or not ((node / NODE_KEY).is_file() and (node / NODE_PUB).is_file()):
            from cryptography.hazmat.primitives.asymmetric import ec

            key = ec.generate_private_key(ec.SECP384R1())
            _write(node / NODE_KEY, key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption()), 0o600)
            _write(node / NODE_PUB, key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n",
                0o644)
            log(f"fedpriv: key pair of {node_role(i)} in {node}")
        _write(node / CA_CERT, ca_pem, 0o644)
        _write(public / f"{node_role(i)}.pub", (node / NODE_PUB).read_bytes(), 0o644)
    os.chmod(ca_dir, 0o700)
    return root


def _cert_hosts(path: Path) -> set[str]:
    """The DNS names and IP addresses a certificate is valid for."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {*san.get_values_for_type(x509.DNSName),
            *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))}


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)  # whatever the umask


def _private_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _new_ca(days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpriv"),
                      x509.NameAttribute(NameOID.COMMON_NAME, "fedpriv deployment CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(key, hashes.SHA384()))
    return key, cert


def _new_server_cert(ca_key, ca_cert, hosts: Sequence[str], days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("the SuperLink certificate needs at least one host name or address")
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP384R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=True, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                ca_ski), critical=False)
            .sign(ca_key, hashes.SHA384()))
    return key, cert


def _chown_tree(root: Path, owner: str) -> None:
    try:
        uid, gid = (int(x) for x in owner.split(":"))
    except ValueError:
        raise ValueError(f"--owner expects UID:GID, got {owner!r}") from None
    for path in [root, *root.rglob("*")]:
        os.chown(path, uid, gid, follow_symlinks=False)


# -- docker-compose -----------------------------------------------------------------------------
_HEADER = """\
# GENERATED by `python -m fedpriv.deployment compose{args}` from fedpriv/deployment.py, the
# module that also builds the process commands of the integration tests (tests/test_deployment.py
# checks that this file equals its rendering): do not edit by hand, regenerate.
#
{mode}
#
# Usage (README.md, section "Deployment"):  docker compose{file} up --build
# The results land in ./{results_dir}/{results}, a folder mounted into the
# SuperLink's container, where the ServerApp runs and writes them.
"""
_SECURE_NOTE = """\
# SECURE (the default): TLS between the SuperNodes, the flwr CLI and the SuperLink, and SuperNode
# authentication: only SuperNodes whose public key the `register` service registered can join.
# The one-shot `setup` service generates the CA, the SuperLink certificate and one key pair per
# SuperNode into ./deploy/certs (git-ignored, never committed); each container mounts only its
# own subfolder. The insecure variant is the opt-in docker-compose.insecure.yml."""
_INSECURE_NOTE = """\
# !!! INSECURE: NO TLS AND NO SUPERNODE AUTHENTICATION !!!
# Every message between the SuperNodes and the SuperLink travels unencrypted and any process that
# reaches the SuperLink can join as a SuperNode. Opt-in, for local experiments only; the secure
# default is docker-compose.yml."""


def compose_yaml(num_nodes: int = 3, secure: bool = True,
                 settings: Mapping[str, Any] | None = None) -> str:
    """The docker-compose file of a deployment of ``num_nodes`` SuperNodes (secure by default);
    ``settings`` are run-config overrides of the submitted run."""
    d = Deployment(num_nodes=num_nodes, certs=CONTAINER_CERTS if secure else None)
    results = f"{CONTAINER_RESULTS}/{RESULTS_FILE}"
    args = "" if num_nodes == 3 else f" --nodes {num_nodes}"
    args += "" if secure else " --insecure"
    args += "".join(f" --set {k}={toml_value(v)}" for k, v in (settings or {}).items())
    out = [_HEADER.format(args=args, mode=_SECURE_NOTE if secure else _INSECURE_NOTE,
                          file="" if secure else " -f docker-compose.insecure.yml",
                          results_dir=RESULTS_DIR, results=RESULTS_FILE)]
    out.append("x-fedpriv-image: &fedpriv-image\n"
               "  # every service runs one image: Flower's official SuperNode image (flwr 1.41.0,\n"
               "  # Python 3.11) with this project installed from its pyproject.toml\n"
               f"  build:\n    context: .\n    dockerfile: {DOCKERFILE}\n"
               f"  image: {IMAGE}\n")
    out.append("services:")
    certs, host_results = "./" + CERTS_DIR, "./" + RESULTS_DIR
    svc: list[tuple[str, dict[str, Any]]] = []
    svc.append(("setup", {
        "#": ("one-shot, as root: certificates and keys (kept if present), folder ownership"
              if secure else "one-shot, as root: the results folder, for the app user"),
        "user": "0:0",
        "command": setup_command(d),
        "volumes": ([f"{certs}:{CONTAINER_CERTS}"] if secure else [])
        + [f"{host_results}:{CONTAINER_RESULTS}"],
    }))
    link_volumes = ([f"{certs}/superlink:{CONTAINER_CERTS}:ro"] if secure else [])
    svc.append(("superlink", {
        "#": ("the ServerApp runs as its subprocess: the results are written here"
              if secure else "INSECURE: no TLS, any SuperNode may join; the ServerApp runs "
              "here"),
        "command": superlink_command(d),
        "volumes": link_volumes + [f"{host_results}:{CONTAINER_RESULTS}"],
        "ports": [f"127.0.0.1:{d.superlink_port}:{d.superlink_port}"],
        "healthcheck": {"test": ["CMD", *health_command(d)], "interval": "2s",
                        "timeout": "5s", "retries": 60},
        "depends_on": {"setup": "service_completed_successfully"},
    }))
    nodes_after = {"superlink": "service_healthy"}
    if secure:
        svc.append(("register", {
            "#": "one-shot: registers every SuperNode's public key with the SuperLink",
            "command": register_command(d),
            "volumes": [f"{certs}/public:{CONTAINER_CERTS}:ro"],
            "depends_on": {"superlink": "service_healthy"},
        }))
        nodes_after = {"register": "service_completed_successfully"}
    for i in range(num_nodes):
        svc.append((node_role(i), {
            "#": f"hosts partition {i} of {num_nodes} (its node config)",
            "command": supernode_command(d, i),
            "volumes": [f"{certs}/{node_role(i)}:{CONTAINER_CERTS}:ro"] if secure else [],
            "restart": "on-failure:3",
            "depends_on": nodes_after,
        }))
    svc.append(("submit", {
        "#": "submits the run with `flwr run`, streams its logs, checks the results file",
        "command": submit_command(d, results, settings),
        "volumes": ([f"{certs}/public:{CONTAINER_CERTS}:ro"] if secure else [])
        + [f"{host_results}:{CONTAINER_RESULTS}:ro"],
        "depends_on": {"superlink": "service_healthy",
                       **{node_role(i): "service_started" for i in range(num_nodes)}},
    }))
    for name, spec in svc:
        out.append(f"  {name}:")
        if "#" in spec:
            out.append(f"    # {spec['#']}")
        out.append("    <<: *fedpriv-image")
        for key in ("user", "command", "volumes", "ports", "healthcheck", "restart",
                    "depends_on"):
            if key not in spec or spec[key] in ([], {}):
                continue
            value = spec[key]
            if key == "depends_on":
                out.append("    depends_on:")
                for dep, condition in value.items():
                    out.append(f"      {dep}:\n        condition: {condition}")
            elif key == "healthcheck":
                out.append("    healthcheck:")
                out.append(_flow("      test: ", value["test"]))
                for k in ("interval", "timeout", "retries"):
                    out.append(f"      {k}: {json.dumps(value[k])}")
            elif key == "command":
                out.append(_flow("    command: ", value))
            elif isinstance(value, list):
                out.append(f"    {key}:")
                out.extend(f"      - {json.dumps(a)}" for a in value)
            else:
                out.append(f"    {key}: {json.dumps(value)}")
    return "\n".join(out) + "\n"


def _flow(prefix: str, items: Sequence[str], width: int = 100) -> str:
    """``prefix[item, item, ...]`` as a YAML flow sequence wrapped under its first item,
    an option and its value kept on one line."""
    words = [json.dumps(x) for x in items]
    groups: list[str] = []
    for word in words:  # "--flag", "value" stay together
        if groups and groups[-1].startswith('"--') and "," not in groups[-1] and (
                not word.startswith('"--')):
            groups[-1] += f", {word}"
        else:
            groups.append(word)
    lines: list[str] = []
    line = prefix + "["
    pad = " " * len(line)
    for i, group in enumerate(groups):
        piece = group + ("]" if i == len(groups) - 1 else ",")
        if i and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = pad + piece
        else:
            line += (" " if i else "") + piece
    lines.append(line)
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """A TOML literal of a run-config value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string


# -- the subcommands ----------------------------------------------------------------------------
def check_health(address: str, root_certificates: str | None, timeout: float = 3.0) -> bool:
    """Whether the SuperLink at ``address`` answers ``GET /health`` with a success."""
    scheme = "http" if root_certificates is None else "https"
    context = None if root_certificates is None else ssl.create_default_context(
        cafile=root_certificates)
    try:
        with urllib.request.urlopen(f"{scheme}://{address}/health", timeout=timeout,
                                    context=context) as response:
            return 200 <= response.status < 300
    except (OSError, http.client.HTTPException):  # refused, TLS failure, not HTTP(S), ...
        return False


def _run(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    print("fedpriv: $ " + shlex.join(argv), flush=True)
    return subprocess.run(list(argv), check=False, **kwargs)


def _tls(args: argparse.Namespace) -> str | None:
    if args.insecure == bool(args.root_certificates):
        raise SystemExit("fedpriv: give either --root-certificates CA (TLS) or --insecure")
    if args.root_certificates:
        ca = Path(args.root_certificates).expanduser().resolve()
        if not ca.is_file():
            raise SystemExit(f"fedpriv: CA certificate {ca} does not exist (generate it with "
                             "`python -m fedpriv.deployment certs DIR`)")
        return str(ca)
    return None


def cmd_health(args: argparse.Namespace) -> int:
    ca = _tls(args)
    deadline = time.monotonic() + args.wait
    while True:
        if check_health(args.superlink, ca):
            print(f"fedpriv: SuperLink at {args.superlink} is up", flush=True)
            return 0
        if time.monotonic() >= deadline:
            print(f"fedpriv: SuperLink at {args.superlink} does not answer", file=sys.stderr)
            return 1
        time.sleep(0.5)


def cmd_register(args: argparse.Namespace) -> int:
    ca = _tls(args)
    if ca is None:
        raise SystemExit("fedpriv: SuperNode registration needs TLS (--root-certificates)")
    write_connection(connection_toml(args.superlink, ca, args.connection))
    for key in args.public_keys:
        proc = _run(register_argv(str(Path(key).expanduser().resolve()), args.connection),
                    capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        print(output.strip(), flush=True)
        if proc.returncode != 0:
            if "already in use" in output:  # registered by an earlier `register`: fine
                continue
            print(f"fedpriv: could not register {key} (exit {proc.returncode})",
                  file=sys.stderr)
            return 1
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from fedpriv.cli import load_run_config
    from fedpriv.config import ConfigError, RunConfig
    from fedpriv.privacy.accounting import InfeasiblePlanError
    from fedpriv.server import check_run

    ca = _tls(args)
    if not Path(args.results).is_absolute():
        raise SystemExit("fedpriv: --results must be an absolute path: the ServerApp writes it "
                         "on the SuperLink's machine, relative to a directory you do not know")
    sets = list(args.set or [])
    try:
        values = {**load_run_config(args.config, sets), "results-path": args.results}
        check_run(RunConfig.from_mapping(values, strict=True))  # plan and budget, first
        # only what differs from the app's defaults goes on the command line
        overrides = {**_explicit(args.config), **_sets(sets), "results-path": args.results}
    except (ConfigError, InfeasiblePlanError) as err:
        print(f"fedpriv: invalid config: {err}", file=sys.stderr)
        return 2
    write_connection(connection_toml(args.superlink, ca, args.connection))
    results = Path(args.results)
    started = time.time()
    proc = _run(submit_argv(args.app, overrides, args.connection), timeout=args.timeout)
    if proc.returncode != 0:
        print(f"fedpriv: `flwr run` failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    if args.no_check:
        return 0
    deadline = time.monotonic() + 30.0  # the log stream may end just before the file lands
    while time.monotonic() < deadline:
        if results.is_file() and results.stat().st_mtime >= started - 1.0:
            print(f"fedpriv: results of this run in {results}", flush=True)
            return 0
        time.sleep(0.5)
    print(f"fedpriv: the run ended but {results} was not written by it (see the SuperLink's "
          "log; --no-check when the SuperLink's files are not visible here)", file=sys.stderr)
    return 1


def _explicit(config: str | None) -> dict[str, Any]:
    if not config:
        return {}
    with Path(config).expanduser().open("rb") as fh:
        return tomllib.load(fh)


def _sets(items: Sequence[str]) -> dict[str, Any]:
    from fedpriv.cli import _split_override

    return dict(_split_override(item) for item in items)


def cmd_setup(args: argparse.Namespace) -> int:
    if args.certs:
        generate_certs(args.certs, args.nodes)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    if args.owner:
        for folder in filter(None, (args.certs, args.results)):
            _chown_tree(Path(folder), args.owner)
    print("fedpriv: setup done", flush=True)
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    # the defaults stay: the SuperLink's own ServerApp runner connects to 127.0.0.1
    hosts = tuple(dict.fromkeys([*DEFAULT_HOSTS, *(args.host or [])]))
    root = generate_certs(args.directory, args.nodes, hosts=hosts, days=args.days,
                          force=args.force)
    print(f"fedpriv: certificates and SuperNode keys in {root} (keep ca/ and every *.key "
          "private; never commit them)")
    return 0


def cmd_compose(args: argparse.Namespace) -> int:
    settings = _sets(args.set or [])
    sys.stdout.write(compose_yaml(args.nodes, secure=not args.insecure, settings=settings))
    return 0


def cmd_commands(args: argparse.Namespace) -> int:
    if not args.insecure and not args.certs:
        raise SystemExit("fedpriv: give --certs DIR (made by `certs DIR`) or --insecure")
    d = Deployment(num_nodes=args.nodes, superlink_host="127.0.0.1", bind_host="127.0.0.1",
                   node_ports=tuple(NODE_PORT + i for i in range(args.nodes)),
                   certs=None if args.insecure else str(Path(args.certs).resolve()),
                   mounted=False, app_dir=str(Path(args.app).resolve()))
    results = str(Path(args.results).expanduser().resolve())
    mode = "TLS + SuperNode authentication" if d.secure else "INSECURE: no TLS, no node auth"
    print(f"# fedpriv deployment as plain processes on 127.0.0.1 ({mode}), in this order;")
    print("# the long-running ones each in a terminal of its own (or with ' &')")
    print("# 1. the SuperLink")
    print(shlex.join(superlink_command(d)))
    if d.secure:
        print("# 2. register the SuperNodes' public keys (once the SuperLink is up)")
        print(shlex.join(register_command(d)))
    print(f"# {3 if d.secure else 2}. one SuperNode per partition")
    for i in range(d.num_nodes):
        print(shlex.join(supernode_command(d, i)))
    print(f"# {4 if d.secure else 3}. submit the run; it ends when the results file is written")
    print(shlex.join(submit_command(d, results, _sets(args.set or []))))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fedpriv.deployment", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def connection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--superlink", required=True, help="SuperLink address HOST:PORT")
        p.add_argument("--root-certificates", help="CA certificate (TLS)")
        p.add_argument("--insecure", action="store_true", help="no TLS (insecure SuperLink)")
        p.add_argument("--connection", default=CONNECTION,
                       help=f"connection name in $FLWR_HOME/config.toml (default {CONNECTION})")

    p = sub.add_parser("certs", help="generate the CA, SuperLink certificate, SuperNode keys")
    p.add_argument("directory")
    p.add_argument("--nodes", type=int, default=3, help="SuperNode key pairs (default 3)")
    p.add_argument("--host", action="append",
                   help="add a name or address of the SuperLink to its certificate "
                        f"(repeat; always valid for {', '.join(DEFAULT_HOSTS)})")
    p.add_argument("--days", type=int, default=365, help="validity (default 365)")
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.set_defaults(func=cmd_certs)

    p = sub.add_parser("compose", help="print the docker-compose file")
    p.add_argument("--nodes", type=int, default=3, help="SuperNodes (default 3)")
    p.add_argument("--insecure", action="store_true", help="no TLS, no SuperNode auth")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="run-config override of the submitted run")
    p.set_defaults(func=cmd_compose)

    p = sub.add_parser("commands", help="print the same deployment as plain processes")
    p.add_argument("--certs", help="certificate folder made by `certs`")
    p.add_argument("--insecure", action="store_true", help="no TLS, no SuperNode auth")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--app", default=".", help="the Flower app (this project's folder)")
    p.add_argument("--results", default=f"results/{RESULTS_FILE}")
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.set_defaults(func=cmd_commands)

    p = sub.add_parser("health", help="exit 0 once the SuperLink answers")
    connection(p)
    p.add_argument("--wait", type=float, default=0.0, help="keep trying for this many seconds")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("register", help="register SuperNode public keys (flwr supernode "
                                        "register)")
    connection(p)
    p.add_argument("public_keys", nargs="+", metavar="KEY.pub")
    p.set_defaults(func=cmd_register)

    p = sub.add_parser("submit", help="submit the run (flwr run), check its results file")
    connection(p)
    p.add_argument("--app", required=True, help="the Flower app folder (pyproject.toml)")
    p.add_argument("--results", required=True,
                   help="absolute results path, on the SuperLink's machine")
    p.add_argument("--config", help="run-config TOML (as for `fedpriv run`)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    p.add_argument("--timeout", type=float, default=None, help="give up after S seconds")
    p.add_argument("--no-check", action="store_true",
                   help="do not wait for the results file (SuperLink on another machine)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("setup", help="(compose) certificates + folder ownership, one-shot")
    p.add_argument("--certs", help="certificate folder to create or complete")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--results", required=True, help="results folder to create")
    p.add_argument("--owner", help="UID:GID to hand the folders to")
    p.set_defaults(func=cmd_setup)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:
        print(f"fedpriv: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

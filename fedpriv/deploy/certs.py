"""TLS certificates and SuperNode keys of a deployment, generated with ``cryptography``.

One folder per role, so that each container (or machine) receives only what it needs: the CA
(its key never leaves ``ca/``), the SuperLink's server certificate, one EC key pair per SuperNode
in OpenSSH format (P-384, a NIST curve as Flower requires for SuperNode authentication) and a
``public/`` folder for whoever registers the nodes. ``cryptography`` (a dependency of flwr) is
imported inside the functions, so building commands never pays for it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpriv.deploy.commands import (
    CA_CERT,
    DEFAULT_HOSTS,
    NODE_KEY,
    NODE_PUB,
    SERVER_CERT,
    SERVER_KEY,
    node_role,
)

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes


def generate_certs(directory: str | os.PathLike[str], num_nodes: int,
                   hosts: Sequence[str] = DEFAULT_HOSTS, days: int = 365,
                   force: bool = False, log: Callable[[str], Any] = print) -> Path:
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
    ca_key: PrivateKeyTypes
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
            not set(hosts) <= cert_hosts(link / SERVER_CERT)):  # a name was added
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


def cert_hosts(path: Path) -> set[str]:
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


def _private_pem(key: PrivateKeyTypes) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _new_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
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


def _new_server_cert(ca_key: PrivateKeyTypes, ca_cert: x509.Certificate, hosts: Sequence[str],
                     days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("the SuperLink certificate needs at least one host name or address")
    if not isinstance(ca_key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey, dsa.DSAPrivateKey,
                               ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)):
        raise TypeError(f"the CA key ({type(ca_key).__name__}) cannot sign certificates")
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


def chown_tree(root: Path, owner: str) -> None:
    """Hand ``root`` and everything under it to ``owner`` ("UID:GID")."""
    try:
        uid, gid = (int(x) for x in owner.split(":"))
    except ValueError:
        raise ValueError(f"--owner expects UID:GID, got {owner!r}") from None
    for path in [root, *root.rglob("*")]:
        os.chown(path, uid, gid, follow_symlinks=False)

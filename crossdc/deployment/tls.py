"""TLS material for a test or small deployment: a private CA and server certificates it signs.

`make_certificates(directory, hosts)` promises, under `directory`:

- ``ca.pem`` / ``ca.key``: a self-signed certificate authority (EC P-256), the file datacenters
  trust (Flower SuperNode ``--root-certificates``, crossdc's API clients);
- ``server.pem`` / ``server.key``: a server certificate signed by that CA, valid for every name
  and IP address in `hosts` (subject alternative names), for the SuperLink's Fleet API front and
  the dashboard/API (Flower SuperLink ``--ssl-certfile/--ssl-keyfile/--ssl-ca-certfile``);
- private keys with file mode 0600, written atomically; existing files are never overwritten
  unless `force` is given.

Production deployments point at their own certificates instead.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


class CertificateError(RuntimeError):
    """Certificates could not be made (bad host name, files in the way)."""


@dataclass(frozen=True)
class CertificatePaths:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


def write_file(path: Path, data: bytes, private: bool) -> None:
    """Write `data` to `path` atomically; mode 0600 when `private`, else 0644."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        host = host.strip()
        if not host:
            raise CertificateError("empty host name")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_certificates(directory: str | Path, hosts: list[str], *, days: int = 365, force: bool = False,
                      organisation: str = "crossdc") -> CertificatePaths:
    """Create the CA and a server certificate for `hosts` under `directory` (see the module docstring)."""
    if not hosts:
        raise CertificateError("at least one host name or address is needed for the server certificate")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = CertificatePaths(directory / "ca.pem", directory / "ca.key", directory / "server.pem", directory / "server.key")
    existing = [p for p in paths.__dict__.values() if p.exists()]
    if existing and not force:
        raise CertificateError(f"{existing[0]} exists; pass --force to replace the certificates in {directory}")
    san = _san(hosts)
    now = datetime.now(UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation),
                         x509.NameAttribute(NameOID.COMMON_NAME, f"{organisation} private CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=5))
               .not_valid_after(now + timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation),
                                            x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
                   .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=days))
                   .add_extension(san, critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
                   .sign(ca_key, hashes.SHA256()))
    write_file(paths.ca_key, _key_pem(ca_key), private=True)
    write_file(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    write_file(paths.server_key, _key_pem(server_key), private=True)
    write_file(paths.server_cert, server_cert.public_bytes(serialization.Encoding.PEM), private=False)
    return paths

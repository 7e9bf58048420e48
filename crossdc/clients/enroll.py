"""A datacenter enrolls: its SuperNode key pair is made here, and only the public half leaves the datacenter.

Promises:

* :func:`node_key` makes the key pair once per state folder (EC P-384, the curve Flower's docs use): the private
  key in OpenSSH format (what ``flower-supernode --auth-supernode-private-key`` reads) with file mode 0600, the
  public key as PEM next to it; an existing key is reused, and replaced only when asked (the old pair is kept
  under a dated name); :func:`enroll` with ``new_key`` replaces it only once the service has enrolled the new one;
* :func:`enroll` sends the public key and the datacenter's facts to ``POST /api/datacenters`` with the operator's
  enrollment token over HTTPS (verified against the CA given) and records the answer in ``enrollment.json``, with
  the Fleet API front the node is to reach (:func:`front_address`); any refusal is an :class:`EnrollmentError` with
  the service's reason, and leaves the key in place for a retry;
* :func:`supernode_auth_key` gives ``flower-supernode`` a key it can read: it reads only OpenSSH private keys (a
  PKCS#8 PEM key made it exit with code 1 and no reason), so an unencrypted EC key in PEM (PKCS#8 or SEC1) is
  converted to an OpenSSH copy (mode 0600) in the state folder, and any other file is refused with one line saying
  why, before the SuperNode starts.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from crossdc.deployment.superlink_control import NIST_CURVES
from crossdc.deployment.tls import write_file

PRIVATE_KEY_FILE = "node-key"
PUBLIC_KEY_FILE = "node-key.pub"
PENDING_KEY_FILE = "node-key.pending"
ENROLLMENT_FILE = "enrollment.json"
#: the OpenSSH copy of a PEM key given to `crossdc node start --auth-key` (see supernode_auth_key)
CONVERTED_KEY_FILE = "auth-key.openssh"
#: the Fleet API front's port (compose.yaml, docs/deployment.md): a front address without a port gets this one
FRONT_PORT = 9092


class EnrollmentError(RuntimeError):
    """The service did not enroll the datacenter (its reason is the message)."""


@dataclass(frozen=True)
class NodeKey:
    private_key: Path
    public_key_pem: str


def _key_pair(private_path: Path, public_path: Path) -> NodeKey:
    """The key pair at these paths, made (EC P-384; private key OpenSSH, 0600) if the private key does not exist."""
    if private_path.exists():
        key = serialization.load_ssh_private_key(private_path.read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise EnrollmentError(f"{private_path} is not an elliptic-curve key; move it away to make a new one")
        if os.stat(private_path).st_mode & 0o077:
            os.chmod(private_path, 0o600)
    else:
        key = ec.generate_private_key(ec.SECP384R1())
        write_file(private_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                   serialization.NoEncryption()), private=True)
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo).decode("ascii")
    if not public_path.exists() or public_path.read_text() != public_pem:
        write_file(public_path, public_pem.encode("ascii"), private=False)
    return NodeKey(private_path, public_pem)


def _set_aside(state_dir: Path) -> None:
    """Move the current key pair aside under a dated name (never deleted)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for file_name in (PRIVATE_KEY_FILE, PUBLIC_KEY_FILE):
        path = state_dir / file_name
        if path.exists():
            path.rename(path.with_name(f"{path.name}.replaced-{stamp}"))


def node_key(state_dir: Path, renew: bool = False) -> NodeKey:
    """The datacenter's SuperNode key pair under `state_dir`, made if it does not exist yet (or if `renew`: the
    old pair is set aside first)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    if renew:
        _set_aside(state_dir)
    return _key_pair(state_dir / PRIVATE_KEY_FILE, state_dir / PUBLIC_KEY_FILE)


def front_address(server: str, front: str | None = None) -> str:
    """The Fleet API front a datacenter's node reaches (``HOST:PORT``): `front` (a bare host gets :data:`FRONT_PORT`),
    else the host of the service URL `server` with :data:`FRONT_PORT` (the operator serves both, compose.yaml so)."""
    if front:
        host, sep, port = front.rpartition(":")
        return front if sep and port.isdigit() and not host.endswith(":") else f"{front}:{FRONT_PORT}"
    host = urlsplit(server).hostname or server
    return f"[{host}]:{FRONT_PORT}" if ":" in host else f"{host}:{FRONT_PORT}"


def supernode_auth_key(path: Path, state_dir: Path) -> Path:
    """A file flower-supernode can read (``--auth-supernode-private-key``: an unencrypted OpenSSH EC private key on
    P-256, P-384 or P-521) holding the private key at `path`: `path` itself when it is one; for such a key in PEM
    (PKCS#8 ``PRIVATE KEY`` or SEC1 ``EC PRIVATE KEY``), an OpenSSH copy written (0600) as `state_dir` /
    :data:`CONVERTED_KEY_FILE`. EnrollmentError, one line saying why, for anything else."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise EnrollmentError(f"--auth-key {path}: {err.strerror or err}") from None
    openssh = data.lstrip().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    try:
        key = (serialization.load_ssh_private_key(data, None) if openssh
               else serialization.load_pem_private_key(data, None))
    except TypeError:  # cryptography's word for a key that needs a password
        raise EnrollmentError(f"--auth-key {path} is encrypted: the SuperNode needs an unencrypted key (mode 0600)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise EnrollmentError(f"--auth-key {path} is not a private key in OpenSSH or PEM format (PKCS#8 or SEC1): the "
                              "SuperNode needs the EC key `crossdc enroll` made (STATE_DIR/node-key)") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, NIST_CURVES):
        raise EnrollmentError(f"--auth-key {path} is not an elliptic-curve key on P-256, P-384 or P-521, the only keys a "
                              "SuperLink accepts")
    if openssh:
        return path
    converted = state_dir / CONVERTED_KEY_FILE
    write_file(converted, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                            serialization.NoEncryption()), private=True)
    return converted


def enroll(server: str, token: str, state_dir: Path, *, name: str, gpus: int, region: str | None = None,
           link_bandwidth_mbps: float | None = None, link_rtt_ms: float | None = None,
           ca_cert: Path | None = None, new_key: bool = False, front: str | None = None,
           timeout_s: float = 60.0) -> dict[str, Any]:
    """Enroll this datacenter with the crossdc service at `server` (``https://host:port``); returns the service's
    record of it, with ``front``, the Fleet API front its node is to reach (:func:`front_address` of `front`), as
    ``enrollment.json`` keeps it. The token goes only into the request's Authorization header. `new_key`: make a new
    key pair first (a suspended datacenter enrolls again so)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    if new_key:  # a pending pair: it becomes the node's key only once the service enrolled it
        for leftover in (PENDING_KEY_FILE, PENDING_KEY_FILE + ".pub"):
            (state_dir / leftover).unlink(missing_ok=True)
        key = _key_pair(state_dir / PENDING_KEY_FILE, state_dir / (PENDING_KEY_FILE + ".pub"))
    else:
        key = node_key(state_dir)
    body = {"name": name, "gpus": gpus, "region": region, "public_key": key.public_key_pem,
            "link_bandwidth_mbps": link_bandwidth_mbps, "link_rtt_ms": link_rtt_ms}
    verify: str | bool = str(ca_cert) if ca_cert is not None else True
    try:
        with httpx.Client(base_url=server.rstrip("/"), verify=verify, timeout=timeout_s) as client:
            answer = client.post("/api/datacenters", json=body, headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as err:
        raise EnrollmentError(f"could not reach {server}: {type(err).__name__}: {err}") from None
    if answer.status_code != 201:
        try:
            reason = answer.json().get("detail", answer.text)
        except ValueError:
            reason = answer.text
        raise EnrollmentError(f"{server} refused the enrollment ({answer.status_code}): {reason}")
    record: dict[str, Any] = {**answer.json(), "front": front_address(server, front)}
    if new_key:
        _set_aside(state_dir)
        (state_dir / PENDING_KEY_FILE).rename(state_dir / PRIVATE_KEY_FILE)
        (state_dir / (PENDING_KEY_FILE + ".pub")).rename(state_dir / PUBLIC_KEY_FILE)
    write_file(state_dir / ENROLLMENT_FILE, json.dumps({"server": server, **record}, indent=2).encode("utf-8"), private=False)
    return record

"""`crossdc certs`: a private CA and a server certificate that a client trusting the CA accepts, and others refuse."""

from __future__ import annotations

import socket
import ssl
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import CROSSDC  # tests/ is on sys.path

from crossdc.deployment.tls import CertificateError, make_certificates


def _serve_once(cert: Path, key: Path) -> tuple[int, threading.Thread]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            for _ in range(2):  # one trusting client, one that refuses the certificate
                conn, _ = listener.accept()
                try:
                    with context.wrap_socket(conn, server_side=True) as tls:
                        tls.sendall(b"hello")
                except (ssl.SSLError, OSError):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


def _connect(port: int, context: ssl.SSLContext, server_name: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname=server_name) as tls:
            return tls.recv(5)


def test_client_trusting_the_ca_connects_and_others_are_refused(tmp_path: Path) -> None:
    paths = make_certificates(tmp_path / "certs", ["localhost", "127.0.0.1"])
    port, thread = _serve_once(paths.server_cert, paths.server_key)
    trusting = ssl.create_default_context(cafile=str(paths.ca_cert))
    assert _connect(port, trusting, "127.0.0.1") == b"hello"
    stranger = ssl.create_default_context()  # the system's CAs only
    with pytest.raises(ssl.SSLCertVerificationError):
        _connect(port, stranger, "127.0.0.1")
    thread.join(timeout=10)


def test_private_keys_are_0600_and_nothing_is_overwritten(tmp_path: Path) -> None:
    paths = make_certificates(tmp_path, ["superlink.example"])
    for key in (paths.ca_key, paths.server_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    before = paths.server_cert.read_bytes()
    with pytest.raises(CertificateError, match="exists"):
        make_certificates(tmp_path, ["superlink.example"])
    assert paths.server_cert.read_bytes() == before
    make_certificates(tmp_path, ["other.example"], force=True)
    assert paths.server_cert.read_bytes() != before


def test_certs_command(tmp_path: Path) -> None:
    done = subprocess.run([CROSSDC, "certs", "--out", str(tmp_path / "c"), "--host", "localhost", "--host", "10.0.0.7"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "c" / "server.pem").exists() and "ca.pem" in done.stdout
    again = subprocess.run([CROSSDC, "certs", "--out", str(tmp_path / "c"), "--host", "localhost"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr.startswith("crossdc: error:") and "--force" in again.stderr

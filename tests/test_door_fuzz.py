"""Malformed input at every door (issue #23): the node service's Unix socket and the Fleet API front, fed truncated,
oversized and random messages. (The dashboard's HTTP API has its own fuzz test, tests/test_dashboard_fuzz.py.)

No mocks: the real node service process (``python -m crossdc.clients.node``) on its Unix socket in tmp_path, and the
real front (`start_front`) on loopback, in front of a real HTTP server on loopback standing in for the SuperLink and
recording every request that reaches it. The cases are drawn from ``random.Random(SEED)``, bounded in number, and every
read has a short timeout: a hang fails the test instead of stalling it.

The node service (its request loop, `crossdc.clients.channel.serve_requests`, is the datacenter trainer's too). Its
socket speaks multiprocessing.connection's frames (a 4-byte big-endian length, or -1 and an 8-byte length, then the
bytes); a connection first passes an HMAC challenge on the node's key (frames of at most 256 bytes), then carries one
pickled request and its answer. Promised and checked:

- a client without the key, whatever it sends (nothing; a cut or oversized length prefix; a frame of random bytes;
  random garbage; a frame cut in the middle), is refused: it gets the challenge and at most a ``#FAILURE#`` frame,
  never ``#WELCOME#``, then the connection is closed; the service logs one "rejected a connection" line for it and
  goes on (before the fix in serve_requests, a client that hung up or sent an oversized prefix stopped the service);
- a client with the key whose request is malformed (a cut or huge length prefix, random bytes, a pickled request cut
  in the middle, a request of the wrong shape) gets an answer ``{"ok": False, "error": "<one line>"}``; one that hangs
  up is let go;
- afterwards the same process still answers a ping correctly, and nothing was written under its state directory.

(Past the handshake a client holds the node's key and is trusted: its request is unpickled. The random request bodies
here start with a byte that is no pickle opcode, so they test the framing and the answer, not the unpickler.)

The Fleet API front, promised and checked:

- every request but ``POST /v1/fleet/<method>`` (other methods, other paths, ``..`` or percent-encoded tricks) is
  answered 403 without reaching the SuperLink (a method uvicorn or Starlette do not route is answered 400/405, and a
  path with a newline 404: refused all the same);
- truncated bodies (a Content-Length or chunk larger than what is sent, then the connection closes) and bodies
  announced far larger than sent are never forwarded, not even in part; a malformed request line or header is answered
  4xx or the connection is closed;
- random binary bodies to a Fleet method reach the SuperLink byte for byte, and its answer comes back;
- the SuperLink never sees anything but a POST to ``/v1/fleet/<method>`` (one segment of letters, digits, '-' and
  '_', nothing a later decoding or dot-segment normalization could turn into another path), and afterwards the front's
  thread is alive and still forwards a valid request.

The front sets no limit of its own on a body's or a header's size (uvicorn with httptools sets none either): an 8 MiB
body is forwarded whole, and an over-long header reaches the SuperLink, whose own limit answers it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickletools
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest

from crossdc.clients.channel import call_trainer, serve_requests
from crossdc.clients.node import node_authkey, node_socket
from crossdc.deployment.fleet_front import RunningFront, is_fleet_request, start_front
from crossdc.experiment.processes import free_port

SEED = 20260423
NODE_CASES = 200
FRONT_CASES = 150
#: the longest any one read may wait: a server that does not answer or close by then hangs
CASE_TIMEOUT_S = 5.0
DATACENTER = "us-east"
#: what a Fleet API method's path must look like when it reaches the SuperLink
FORWARDABLE = re.compile(r"/v1/fleet/[A-Za-z0-9_-]+")


# ---------------------------------------------------------------------------------------------------------------------
# the node service


@pytest.fixture
def node_service(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path, bytes, Path]]:
    """The real node service on its socket, as tests/test_node_service.py starts it (its log in a file: a pipe nobody
    reads would fill up with the rejections and block it)."""
    state_dir = tmp_path / "node-state"
    log_path = tmp_path / "node-service.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "crossdc.clients.node", "--state-dir", str(state_dir),
                                    "--datacenter", DATACENTER], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    key = node_authkey(state_dir)
    deadline = time.monotonic() + 60
    while not node_socket(state_dir).exists():
        assert process.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")
        time.sleep(0.05)
    yield process, state_dir, key, log_path
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=30)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _read_frame(sock: socket.socket) -> bytes:
    (size,) = struct.unpack("!i", _recv_exactly(sock, 4))
    return _recv_exactly(sock, size)


def _read_to_eof(sock: socket.socket) -> bytes:
    """All the server sends until it closes the connection (a reset counts as closed); TimeoutError if it does not."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _frames(data: bytes) -> list[bytes]:
    frames = []
    while data:
        assert len(data) >= 4, f"a cut frame header: {data!r}"
        (size,) = struct.unpack("!i", data[:4])
        assert 0 <= size <= len(data) - 4, f"a cut frame: {data!r}"
        frames.append(data[4:4 + size])
        data = data[4 + size:]
    return frames


def _send_and_half_close(sock: socket.socket, payload: bytes) -> None:
    """Send `payload` and end the sending side; a server that already closed the connection refused it, which is fine."""
    try:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
    except (BrokenPipeError, ConnectionResetError):
        pass


#: bytes that start no pickle: a request body starting with one is refused at its first byte
NOT_OPCODES = bytes(sorted(set(range(256)) - {op.code.encode("latin-1")[0] for op in pickletools.opcodes}))
UNAUTHENTICATED = ("empty", "truncated-prefix", "oversized", "random-frame", "garbage", "cut-frame")
AUTHENTICATED = ("truncated-prefix", "oversized", "random-frame", "cut-frame", "wrong-shape", "hang-up")
#: pickled requests the service must refuse with an answer (none of them may prepare a run)
WRONG_SHAPES: tuple[object, ...] = (
    42, "ping", [1, 2, 3], None, {}, {"op": 7}, {"op": "train"}, {"op": "prepare"},
    {"op": "prepare", "run_id": "../escape", "config": "{}"}, {"op": "prepare", "run_id": ".hidden", "config": "{}"},
    {"op": "prepare", "run_id": "fuzz-run"}, {"op": "prepare", "run_id": "fuzz-run", "config": "{not json"},
    {"op": "prepare", "run_id": "fuzz-run", "config": json.dumps({"run": 1})}, {"op": "prepare", "run_id": 5, "config": []},
)


def _oversized_prefix(rng: random.Random, limit: int) -> bytes:
    if rng.random() < 0.5:
        return struct.pack("!i", rng.randint(limit + 1, 2**31 - 1))
    return struct.pack("!i", -1) + struct.pack("!Q", rng.randint(max(limit + 1, 2**31), 2**64 - 1))


def _connect_unix(sock_path: Path) -> socket.socket:
    """A connection to the service, with CASE_TIMEOUT_S on every read; TimeoutError if it accepts none by then."""
    deadline = time.monotonic() + CASE_TIMEOUT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CASE_TIMEOUT_S)
        try:
            sock.connect(str(sock_path))
            return sock
        except BlockingIOError:  # its listener's backlog (one connection) is full: the service has yet to accept one
            sock.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the service accepted no connection within {CASE_TIMEOUT_S}s") from None
            time.sleep(0.005)


def _unauthenticated_case(sock_path: Path, rng: random.Random, kind: str) -> None:
    """One connection without the key; asserts it was refused (challenge, at most a failure, then closed)."""
    with _connect_unix(sock_path) as sock:
        if kind == "empty":
            return
        read_challenge = rng.random() < 0.7
        frames: list[bytes] = []
        if read_challenge:
            frames.append(_read_frame(sock))
        if kind == "truncated-prefix":
            payload = rng.randbytes(rng.randint(1, 3))
        elif kind == "oversized":  # the handshake's answer may be 256 bytes at most
            payload = _oversized_prefix(rng, 256) + rng.randbytes(rng.randint(0, 64))
        elif kind == "random-frame":
            size = rng.randint(0, 256)
            payload = struct.pack("!i", size) + rng.randbytes(size)
        elif kind == "garbage":
            payload = rng.randbytes(rng.randint(1, 2048))
        else:  # cut-frame
            size = rng.randint(2, 256)
            payload = struct.pack("!i", size) + rng.randbytes(size // 2)
        _send_and_half_close(sock, payload)
        frames += _frames(_read_to_eof(sock))
    assert frames and frames[0].startswith(b"#CHALLENGE#"), (kind, frames)
    assert all(frame == b"#FAILURE#" for frame in frames[1:]) and len(frames) <= 2, (kind, frames)


def _authenticated_case(sock_path: Path, key: bytes, rng: random.Random, kind: str) -> None:
    """One connection with the key carrying a malformed request; asserts the answer is a one-line refusal."""
    connection: Connection = Client(str(sock_path), family="AF_UNIX", authkey=key)
    with connection:
        if kind == "hang-up":
            return
        if kind == "wrong-shape":
            connection.send(rng.choice(WRONG_SHAPES))
        else:
            if kind == "truncated-prefix":
                payload = rng.randbytes(rng.randint(1, 3))
            elif kind == "oversized":  # past the handshake no limit is set: the size is refused when it cannot be read
                payload = _oversized_prefix(rng, 2**20)
            elif kind == "random-frame":
                body = bytes([rng.choice(NOT_OPCODES)]) + rng.randbytes(rng.randint(0, 4096))
                payload = struct.pack("!i", len(body)) + body
            else:  # cut-frame: a real request, cut in the middle
                body = bytes(ForkingPickler.dumps({"op": "ping", "pad": rng.randbytes(rng.randint(0, 4096))}))
                payload = struct.pack("!i", len(body)) + body[:rng.randint(0, len(body) - 1)]
            os.write(connection.fileno(), payload)
            with socket.socket(fileno=os.dup(connection.fileno())) as sock:  # the same socket: end its sending side
                sock.shutdown(socket.SHUT_WR)
        assert connection.poll(CASE_TIMEOUT_S), f"no answer to a malformed request ({kind}) within {CASE_TIMEOUT_S}s"
        answer = connection.recv()
    assert isinstance(answer, dict) and answer.get("ok") is False, (kind, answer)
    assert isinstance(answer.get("error"), str) and answer["error"] and "\n" not in answer["error"], (kind, answer)


def _tree(root: Path) -> dict[str, str]:
    """What is under `root`: each path with its kind, a file with its content's digest."""
    tree = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            kind = f"link to {os.readlink(path)}"
        elif path.is_dir():
            kind = "dir"
        elif path.is_file():
            kind = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            kind = "special"
        tree[str(path.relative_to(root))] = kind
    return tree


@pytest.mark.timeout(120)
def test_the_node_service_refuses_malformed_connections_and_goes_on(node_service) -> None:
    process, state_dir, key, log_path = node_service
    sock_path = node_socket(state_dir)
    first = call_trainer(sock_path, key, {"op": "ping"}, connect_timeout_s=10)
    assert first == {"ok": True, "pid": process.pid, "datacenter": DATACENTER, "runs": []}
    before = _tree(state_dir)
    rng = random.Random(SEED)
    kinds = [("unauthenticated", kind) for kind in UNAUTHENTICATED] + [("authenticated", kind) for kind in AUTHENTICATED]
    cases = kinds + [rng.choice(kinds) for _ in range(NODE_CASES - len(kinds))]  # every kind at least once
    rng.shuffle(cases)
    started = time.monotonic()
    for number, (door, kind) in enumerate(cases):
        try:
            if door == "unauthenticated":
                _unauthenticated_case(sock_path, rng, kind)
            else:
                _authenticated_case(sock_path, key, rng, kind)
        except TimeoutError:
            pytest.fail(f"case {number} ({door} {kind}) hung: no answer and no close within {CASE_TIMEOUT_S}s")
        except (ConnectionError, FileNotFoundError, EOFError) as err:
            time.sleep(0.2)
            if process.poll() is None:
                raise
            pytest.fail(f"the service exited (code {process.returncode}) at case {number} ({door} {kind}): {err!r}; "
                        f"its log:\n{log_path.read_text(errors='replace')[-3000:]}")
    elapsed = time.monotonic() - started
    assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
    assert call_trainer(sock_path, key, {"op": "ping"}, connect_timeout_s=10) == first
    assert _tree(state_dir) == before  # nothing written, not even in part: no run, no settings, no state store
    # every connection without the key was refused once (none was let in), each in the service's log
    refused = log_path.read_text(errors="replace").count("rejected a connection")
    assert refused == sum(door == "unauthenticated" for door, _ in cases)
    assert elapsed < 60, f"{len(cases)} cases took {elapsed:.1f}s"


def test_the_request_loop_still_ends_when_its_listener_is_closed(tmp_path: Path) -> None:
    """The other half of serve_requests' promise: a failed handshake goes on, a closed listener ends the loop."""
    listener = Listener(str(tmp_path / "closed.sock"), family="AF_UNIX", authkey=b"k" * 32)
    listener.close()
    done = threading.Event()

    def loop() -> None:
        serve_requests(listener, lambda request: {"ok": True}, logging.getLogger("test_door_fuzz"))
        done.set()

    threading.Thread(target=loop, daemon=True).start()
    assert done.wait(10)


# ---------------------------------------------------------------------------------------------------------------------
# the Fleet API front


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:  # a client gone mid-request is no news here
        pass


def _upstream_handler(upstream: Upstream) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def parse_request(self) -> bool:
            ok = super().parse_request()
            if getattr(self, "command", None):  # every request line that reached the SuperLink, even one it refuses
                with upstream.lock:
                    upstream.lines.append((self.command, self.path))
            return ok

        def __getattr__(self, name: str):  # do_POST, do_GET, ...: whatever the method, record it and answer
            if name.startswith("do_"):
                return self._answer
            raise AttributeError(name)

        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            with upstream.lock:
                upstream.bodies.append((self.path, self.headers.get("content-type", ""), body))
            reply = b"stub:" + hashlib.sha256(body).hexdigest().encode()
            self.send_response(200)
            self.send_header("content-type", "application/protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    return Handler


class Upstream:
    """A plain HTTP server on loopback standing in for the SuperLink: it records every request line it receives and
    every body it reads, and answers ``stub:<sha256 of the body>``."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self.bodies: list[tuple[str, str, bytes]] = []  # (path, content type, body)
        self.lock = threading.Lock()
        self.server = _QuietServer(("127.0.0.1", 0), _upstream_handler(self))

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"


@pytest.fixture
def front() -> Iterator[tuple[RunningFront, Upstream]]:
    upstream = Upstream()
    serving = threading.Thread(target=upstream.server.serve_forever, name="fake-superlink", daemon=True)
    serving.start()
    running = start_front(upstream.url, "127.0.0.1", free_port())
    yield running, upstream
    running.stop()
    upstream.server.shutdown()
    upstream.server.server_close()


def _status(answer: bytes) -> int | None:
    """The status of an HTTP answer, None when the front closed the connection without one."""
    if not answer:
        return None
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", answer)
    assert match, f"not an HTTP answer: {answer[:200]!r}"
    return int(match.group(1))


def _raw(port: int, data: bytes, ending: str) -> int | None:
    """Send `data` on a fresh connection; the status the front answered, None if it closed without answering.

    `ending`: "answer" (the request says ``Connection: close``: read until the front answers and closes),
    "half-close" (end the sending side after `data`, as a cut request's client going away does, then read until the
    front closes) or "close" (close the connection at once, reading nothing)."""
    with socket.create_connection(("127.0.0.1", port), timeout=CASE_TIMEOUT_S) as sock:
        if ending == "close":
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(data)
            return None
        if ending == "half-close":
            _send_and_half_close(sock, data)
        else:
            sock.sendall(data)
        return _status(_read_to_eof(sock))


def _request(method: str, target: str, body: bytes = b"", headers: str = "") -> bytes:
    return (f"{method} {target} HTTP/1.1\r\nHost: front\r\nConnection: close\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
            .encode("latin-1") + body)


ROUTED_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
OTHER_METHODS = ("TRACE", "PROPFIND", "MKCOL", "LOCK", "PURGE", "FOO", "post", "GETT")
OUTSIDE = ("/", "/docs", "/openapi.json", "/health", "/v1/control/list-runs", "/v1/control/start-run", "/v1/control/stop-run",
           "/v1/serverappio/pull-messages", "/v1/serverappio/get-run", "/v1/fleetx/pull-messages", "/v1/fleet", "/v1/fleet/",
           "/V1/FLEET/pull-messages", "//v1/fleet/pull-messages", "/v2/fleet/pull-messages", "/api/v1/fleet/pull-messages")
#: fleet-looking paths that would reach the SuperLink as another path (or none): refused
TRICKS = ("/v1/fleet/../control/list-runs", "/v1/fleet/%2e%2e/control/list-runs", "/v1/fleet/%2E%2E/control/start-run",
          "/v1/fleet/%252e%252e/control/list-runs", "/v1/fleet/pull-messages%2F..%2F..%2Fcontrol%2Flist-runs",
          "/v1/fleet/.%2e/control/list-runs", "/v1/fleet/pull-messages%3Fx=1", "/v1/fleet/pull-messages%23frag",
          "/v1/fleet/pull-messages%00", "/v1/fleet/pull%20messages", "/v1/fleet/pull-messages/extra", "/v1/fleet//control",
          "/v1/fleet/%2fcontrol%2flist-runs", "/v1/fleet/%C3%A9", "/v1/fleet/.", "/v1/fleet/..")
FLEET_METHODS = ("pull-messages", "push-messages", "activate-node", "send-node-heartbeat", "get-run", "push-object")
MALFORMED = (
    b"GET\r\n\r\n", b"GET /\r\n\r\n", b"\r\n\r\n\r\n", b" / HTTP/1.1\r\n\r\n", b"POST /v1/fleet/pull-messages HTTP/9.9\r\n\r\n",
    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nContent-Length: -5\r\n\r\nabc",
    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nContent-Length: abc\r\n\r\nabc",
    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde",
    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nTransfer-Encoding: gzip, chunked, bogus\r\n\r\n0\r\n\r\n",
    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nNo colon here\r\n\r\n",
    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nBad Name: x\r\n\r\n",
    b"POST /v1/fleet/pull-messages HTTP/1.1\r\nX-Nul: a\x00b\r\n\r\n",
    b"POST /v1/fleet/pull\x00messages HTTP/1.1\r\n\r\n",
    b"POST /v1/fleet/pull messages HTTP/1.1\r\n\r\n",
    b"POST http://superlink.example/v1/control/list-runs HTTP/1.1\r\nHost: front\r\n\r\n",
    b"CONNECT 127.0.0.1:9091 HTTP/1.1\r\nHost: 127.0.0.1:9091\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS ClientHello's start, on the plain-HTTP port
)


def _mutated(rng: random.Random) -> bytes:
    """A valid Fleet request with a few bytes flipped, inserted or dropped (it may stay valid and be forwarded)."""
    data = bytearray(_request("POST", f"/v1/fleet/{rng.choice(FLEET_METHODS)}", rng.randbytes(rng.randint(0, 64)),
                              "Content-Type: application/protobuf\r\n"))
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data))
        action = rng.randrange(3)
        if action == 0:
            data[at] = rng.randrange(256)
        elif action == 1:
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        else:
            del data[at:at + rng.randint(1, 8)]
    return bytes(data)


def _random_path_tail(rng: random.Random) -> str:
    """A short path tail of letters and percent-encoded random bytes (a valid request target)."""
    parts = []
    for _ in range(rng.randint(0, 6)):
        if rng.random() < 0.5:
            parts.append(rng.choice("abcdefghijklmnopqrstuvwxyz-_./0123456789"))
        else:
            parts.append(f"%{rng.randrange(256):02X}")
    return "".join(parts)


@dataclass
class FrontCase:
    kind: str
    data: bytes
    #: how the client ends: "answer", "half-close" or "close" (see _raw)
    ending: str
    #: the answers this case may get (None: the connection closed without one)
    allowed: set[int | None]


def _front_case(rng: random.Random, kind: str, number: int) -> FrontCase:
    fourxx: set[int | None] = set(range(400, 500))
    if kind == "outside":  # a routed method, a path outside the Fleet API: 403
        method, path = rng.choice(ROUTED_METHODS), rng.choice(OUTSIDE) + _random_path_tail(rng)
        if is_fleet_request(method, unquote(path)):
            path = "/v1/control/" + path
        newline = "\n" in unquote(path)  # Starlette routes no path with a newline: 404, refused all the same
        return FrontCase(kind, _request(method, path, rng.randbytes(rng.randint(0, 256))), "answer", {404} if newline else {403})
    if kind == "other-method":
        method = rng.choice(OTHER_METHODS)
        path = rng.choice((*OUTSIDE, *(f"/v1/fleet/{name}" for name in FLEET_METHODS)))
        return FrontCase(kind, _request(method, path), "half-close", fourxx | {None})
    if kind == "trick":  # fleet-looking, but not one Fleet method's plain path
        method, path = rng.choice(("POST", "POST", "GET")), rng.choice(TRICKS)
        # Starlette reads a decoded '?' or '#' as the start of a query or fragment: what is left of the path, a Fleet
        # method's, is forwarded (without the rest); the checks after the cases see that it arrived as such
        cut = method == "POST" and bool(re.fullmatch(r"/v1/fleet/[a-z-]+[?#].*", unquote(path)))
        return FrontCase(kind, _request(method, path), "answer", {200, 403} if cut else {403})
    if kind == "truncated":  # a body (or chunk) announced larger than sent, then the connection ends: never forwarded
        path = f"/v1/fleet/truncated-{number}"
        announced = rng.randint(1, 200_000)
        if rng.random() < 0.7:
            data = _request("POST", path, b"")[:-2].replace(b"Content-Length: 0", f"Content-Length: {announced}".encode())
            data += b"\r\n" + rng.randbytes(rng.randint(0, announced - 1))
        else:
            data = (f"POST {path} HTTP/1.1\r\nHost: front\r\nTransfer-Encoding: chunked\r\n\r\n{announced:x}\r\n".encode()
                    + rng.randbytes(rng.randint(0, announced - 1)))
        return FrontCase(kind, data, rng.choice(("half-close", "close")), fourxx | {None})
    if kind == "oversized":  # a body announced far beyond anything sent: never forwarded
        path = f"/v1/fleet/oversized-{number}"
        data = (f"POST {path} HTTP/1.1\r\nHost: front\r\nContent-Length: {rng.randint(10**10, 10**18)}\r\n\r\n".encode()
                + rng.randbytes(rng.randint(0, 4096)))
        return FrontCase(kind, data, rng.choice(("half-close", "close")), fourxx | {None})
    if kind == "long-header":  # no limit at the front: forwarded, and the SuperLink's own limit answers
        header = f"X-Fuzz: {'a' * rng.randint(20_000, 200_000)}\r\n"
        return FrontCase(kind, _request("POST", f"/v1/fleet/{rng.choice(FLEET_METHODS)}", b"", header), "answer",
                         set(range(400, 600)) | {200, None})
    if kind == "long-target":  # a Fleet method's name 20-200 kB long: likewise
        target = "/v1/fleet/" + "a" * rng.randint(20_000, 200_000)
        return FrontCase(kind, _request("POST", target), "answer", set(range(400, 600)) | {200, None})
    if kind == "malformed":
        return FrontCase(kind, rng.choice(MALFORMED), "half-close", fourxx | {None})
    if kind == "garbage":
        return FrontCase(kind, rng.randbytes(rng.randint(1, 4096)), "half-close", fourxx | {None})
    assert kind == "mutated"  # may still be a valid Fleet request: then the SuperLink answers 200
    return FrontCase(kind, _mutated(rng), "half-close", set(range(400, 600)) | {200, None})


FRONT_KINDS = ("outside", "other-method", "trick", "truncated", "oversized", "long-header", "long-target", "malformed",
               "garbage", "mutated", "random-body")


@pytest.mark.timeout(120)
def test_the_front_refuses_malformed_requests_and_forwards_only_fleet_posts(front) -> None:
    running, upstream = front
    port = int(running.url.rsplit(":", 1)[1])
    rng = random.Random(SEED)
    cases = list(FRONT_KINDS) + [rng.choice(FRONT_KINDS) for _ in range(FRONT_CASES - len(FRONT_KINDS))]
    rng.shuffle(cases)
    answered: dict[int | None, int] = {}
    forwarded_bodies = 0
    started = time.monotonic()
    with httpx.Client(base_url=running.url, timeout=CASE_TIMEOUT_S) as client:
        for number, kind in enumerate(cases):
            try:
                if kind == "random-body":  # a well-formed Fleet call with random bytes: forwarded byte for byte
                    body = rng.randbytes(rng.choice((0, rng.randint(1, 512), rng.randint(512, 65536))))
                    reply = client.post(f"/v1/fleet/{rng.choice(FLEET_METHODS)}", content=body,
                                        headers={"content-type": "application/protobuf"})
                    assert reply.status_code == 200 and reply.content == b"stub:" + hashlib.sha256(body).hexdigest().encode()
                    forwarded_bodies += 1
                    continue
                case = _front_case(rng, kind, number)
                status = _raw(port, case.data, case.ending)
            except (TimeoutError, httpx.TimeoutException):
                pytest.fail(f"case {number} ({kind}) hung: no answer and no close within {CASE_TIMEOUT_S}s")
            assert status in case.allowed, f"case {number} ({kind}) answered {status}: {case.data[:300]!r}"
            answered[status] = answered.get(status, 0) + 1
        elapsed = time.monotonic() - started
        assert running.server.thread.is_alive()
        # an 8 MiB body: no limit at the front, forwarded whole
        big = rng.randbytes(8 << 20)
        reply = client.post("/v1/fleet/push-object", content=big, headers={"content-type": "application/protobuf"})
        assert reply.status_code == 200 and reply.content == b"stub:" + hashlib.sha256(big).hexdigest().encode()
        # and afterwards a valid call still passes, unchanged
        reply = client.post("/v1/fleet/pull-messages", content=b"\x08\x01", headers={"content-type": "application/protobuf"})
        assert reply.status_code == 200 and reply.content == b"stub:" + hashlib.sha256(b"\x08\x01").hexdigest().encode()
    assert upstream.bodies[-1] == ("/v1/fleet/pull-messages", "application/protobuf", b"\x08\x01")
    assert running.server.thread.is_alive()
    # the SuperLink saw nothing but POSTs to one Fleet method's plain path; nothing cut short reached it
    with upstream.lock:
        lines, bodies = list(upstream.lines), list(upstream.bodies)
    strays = [(method, path) for method, path in lines if method != "POST" or not FORWARDABLE.fullmatch(path)]
    assert strays == []
    assert not [path for _, path in lines if "truncated-" in path or "oversized-" in path]
    assert len(bodies) >= forwarded_bodies + 2
    assert answered.get(403, 0) > 0 and sum(running.stats.refused.values()) >= answered.get(403, 0)
    assert not [key for key in running.stats.refused if is_fleet_request(*key)]
    assert elapsed < 60, f"{len(cases)} cases took {elapsed:.1f}s"


def test_the_front_passes_every_fleet_method_of_flwr_and_nothing_else() -> None:
    """The front's rule against the routes of the installed flwr's SuperLink: every Fleet method passes, no Control or
    ServerAppIo one does, and a path that a decoding or normalization upstream could turn into another does not."""
    from flwr.supercore.protobuf.translation import PROTOBUF_REQUEST_TYPES

    fleet = [(method, path) for method, path in PROTOBUF_REQUEST_TYPES if path.startswith("/v1/fleet/")]
    assert len(fleet) >= 10
    assert all(is_fleet_request(method, path) for method, path in fleet)
    assert not [key for key in PROTOBUF_REQUEST_TYPES if key not in fleet and is_fleet_request(*key)]
    assert not [path for path in TRICKS if is_fleet_request("POST", unquote(path))]

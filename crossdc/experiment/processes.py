"""Child processes that must never outlive the command that started them.

Promises: every process is started in its own session (process group), so
stopping it also stops what it spawned (Flower's SuperExec, ServerApp and
ClientApp processes); :meth:`ProcessGroup.stop_all` stops them in reverse
start order, SIGTERM first and SIGKILL after a grace period, and reaps them.

A process a run starts dies with the process that started the run (its
*root*), even when that one dies by SIGKILL: a direct child gets SIGKILL from
the kernel (:func:`die_with_parent`), and every crossdc process, however deep
and whoever its parent (Flower's SuperExec, a fork server, a trainer), calls
:func:`die_with_run_root` first thing, which SIGKILLs it as soon as the root
named by :data:`RUN_ROOT_ENV` is gone (or at once if it is gone already).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1
try:  # loaded once here: a forked child must not call the dynamic loader
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


class PortInUse(RuntimeError):
    """A port the run needs is already bound by another process."""


def ensure_port_free(host: str, port: int) -> None:
    """Raise PortInUse if a server could not listen on (host, port) now (connections in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            raise PortInUse(f"port {port} on {host} is already in use; stop what holds it or choose another port") from None


#: where free_port looks: below Linux's default ephemeral range (32768–60999), from which the kernel picks the local
#: port of every outgoing connection, so that none takes the port between free_port and the server's start
FREE_PORT_RANGE = (20000, 32767)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago: one at random in FREE_PORT_RANGE (the kernel's pick if none is)."""
    low, high = FREE_PORT_RANGE
    for _ in range(200):
        port = low + secrets.randbelow(high - low + 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float, alive: ManagedProcess | None = None) -> None:
    """Block until something accepts connections on (host, port); fail early if `alive` dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and alive.process.poll() is not None:
            raise RuntimeError(f"{alive.name} exited with code {alive.process.returncode} before listening on {port}; see {alive.log_path}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listened on {host}:{port} within {timeout_s:.0f}s")


@dataclass
class ManagedProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


class ProcessGroup:
    """The processes of one local run."""

    def __init__(self) -> None:
        self.processes: list[ManagedProcess] = []

    def start(self, name: str, command: list[str], log_path: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None, preexec: Callable[[], None] | None = None) -> ManagedProcess:
        """Start `command` in a session of its own, output to `log_path`; `preexec` runs in the child before exec
        (by default: stop when this process dies; EmulatedNetwork.preexec also enters a datacenter's namespace)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "ab")
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=cwd, start_new_session=True, preexec_fn=preexec or die_with_parent,
        )
        managed = ManagedProcess(name, process, log_path, log_file)
        self.processes.append(managed)
        return managed

    def pids(self) -> list[int]:
        return [m.process.pid for m in self.processes]

    def find(self, name: str) -> ManagedProcess | None:
        return next((m for m in self.processes if m.name == name), None)

    def kill(self, name: str) -> int:
        """SIGKILL the named process and everything in its group (a crash, as far as it can tell), reap it and
        forget it; returns its pid."""
        managed = self.find(name)
        if managed is None:
            raise KeyError(f"no process named {name!r} in this group")
        _kill_and_reap(managed, timeout_s=10)
        self.processes.remove(managed)
        return managed.process.pid

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop every process group, newest first; SIGKILL what ignores SIGTERM; reap all."""
        for managed in reversed(self.processes):
            _signal_group(managed.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for managed in reversed(self.processes):
            remaining = max(0.0, deadline - time.monotonic())
            try:
                managed.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                pass
            _kill_and_reap(managed, timeout_s=5)  # whatever the leader left behind in its group goes too
        self.processes.clear()


def _kill_and_reap(managed: ManagedProcess, timeout_s: float) -> None:
    """SIGKILL the process's whole group, wait for the leader up to `timeout_s`, close its log."""
    _signal_group(managed.process, signal.SIGKILL)
    try:
        managed.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    managed.log_file.close()


def venv_bin(name: str) -> str:
    """An executable of this virtualenv (Flower's console scripts live beside python), else `name` on PATH."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


#: how often Flower's SuperExec asks for a ClientApp or ServerApp to launch (its own setting; flwr 1.42's default 1 s
#: adds half a second on average to every message a SuperNode handles)
SUPEREXEC_TASK_POLL_S = 0.1


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower's processes: this virtualenv first on PATH (they start each other by name:
    flower-superexec, flwr-serverapp, flwr-clientapp), a private FLWR_HOME, no telemetry, no update check."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(FLWR_HOME=str(flwr_home), FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", PYTHONUNBUFFERED="1",
               FLWR_SUPEREXEC_TASK_POLL_INTERVAL=str(SUPEREXEC_TASK_POLL_S))
    return env


def die_with_parent() -> None:
    """In the child, before exec: ask the kernel for SIGKILL when the starting process dies (even by SIGKILL).

    SIGKILL, not SIGTERM: a parent that died left nobody to stop its children in order, and a child slow to act on
    SIGTERM (a trainer stopping its worker group, Flower's graceful exits) outlived it by seconds. The kernel sends it
    when the *thread* that started the child ends: start children from a thread that lives as long as they should.
    Processes deeper down are covered by :func:`die_with_run_root`."""
    if _LIBC is not None:  # elsewhere than Linux the orchestrator's own clean-up still applies
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_parent_now(parent_pid: int) -> None:
    """In a process already running (not a preexec) that `parent_pid` started: ask the kernel for SIGKILL when that
    parent (its starting thread) ends, and SIGKILL this process at once if it has ended already (getppid() is no longer
    `parent_pid`): a parent that died before the request would never send the signal."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        _kill_self()


#: names the process the run's processes live and die with (its root: `crossdc run`, `crossdc resume`, `crossdc node
#: start`, a test's own process) as "PID:START", START being its start time in clock ticks since boot, so that a
#: recycled pid is never taken for it; set by whoever starts the run (:func:`run_root_env`), inherited by everything
#: the run starts, Flower's processes and what they start included
RUN_ROOT_ENV = "CROSSDC_RUN_ROOT"
#: the process whose watch die_with_run_root started (a forked child inherits the value, not the thread)
_watching_in: int | None = None
#: how often a watch without a pidfd (older kernels) looks whether the root is still there
ROOT_POLL_S = 0.1


def process_start(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (tells a process from a later one with its recycled pid);
    None if there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_identity(pid: int) -> str | None:
    """"PID:START" of the live process `pid` (see :data:`RUN_ROOT_ENV`), None if there is none."""
    start = process_start(pid)
    return None if start is None else f"{pid}:{start}"


def parse_process_identity(value: str) -> tuple[int, int] | None:
    """(pid, start) of a "PID:START" identity; None for anything else (empty, malformed, non-positive)."""
    pid, sep, start = value.strip().partition(":")
    if not sep or not pid.isdigit() or not start.isdigit() or int(pid) <= 0:
        return None
    return int(pid), int(start)


def run_root_env(pid: int | None = None) -> dict[str, str]:
    """The environment entry that makes `pid` (default: this process) the root of the processes started with it."""
    identity = process_identity(os.getpid() if pid is None else pid)
    return {} if identity is None else {RUN_ROOT_ENV: identity}


def same_process_alive(pid: int, start: int) -> bool:
    """Whether the process `pid` that started at `start` is still running (not gone, not a zombie, not recycled)."""
    return process_start(pid) == start and is_running(pid)


def die_with_run_root(environ: Mapping[str, str] | None = None) -> int | None:
    """Call first thing in every crossdc process of a run: SIGKILL this process as soon as the run's root (named by
    :data:`RUN_ROOT_ENV` in `environ`, default this process's environment) has died, and at once if it already has
    (it died, or its pid now names another process, before this process got here: the race of any parent-death
    signal set late). A daemon thread waits on the root's pidfd (it polls every :data:`ROOT_POLL_S` where pidfds do
    not exist); it neither depends on this process's parent nor on which of the parent's threads started it.
    Returns the root's pid, or None when there is nothing to watch (no root named, or this process is the root)."""
    global _watching_in
    value = (os.environ if environ is None else environ).get(RUN_ROOT_ENV, "")
    root = parse_process_identity(value)
    if root is None or root[0] == os.getpid():
        return None
    pid, start = root
    if _watching_in == os.getpid():  # called twice in one process (a fork's child watches again: it has no thread)
        return pid
    _watching_in = os.getpid()
    pidfd: int | None = None
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        _kill_self()
    except (AttributeError, OSError):  # no pidfd here: poll
        pidfd = None
    if not same_process_alive(pid, start):  # checked once the pidfd is open: from here on it names the root
        _kill_self()
    threading.Thread(target=_await_root, args=(pid, start, pidfd), name="crossdc-run-root", daemon=True).start()
    return pid


def _await_root(pid: int, start: int, pidfd: int | None) -> None:
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while not poller.poll():  # readable once the root has exited
            pass
    else:
        while same_process_alive(pid, start):
            time.sleep(ROOT_POLL_S)
    _kill_self()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


_CLONE_NEWNET = 0x40000000


def enter_network_namespace(path: str) -> None:
    """Move the calling process (in a child, before exec) into the network namespace bound at `path`."""
    if _LIBC is None:
        raise OSError("no libc: network namespaces need Linux")
    fd = os.open(path, os.O_RDONLY)
    try:
        if _LIBC.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({path}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment has name=value (finds what Flower spawned detached, e.g. its SuperExec)."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def kill_processes_with_env(name: str, value: str, grace_s: float = 5.0,
                            first: signal.Signals = signal.SIGTERM) -> list[int]:
    """Send `first` (SIGTERM), then SIGKILL after `grace_s`, to every process whose environment has name=value;
    returns their pids. With `first` SIGKILL, waits up to `grace_s` for them to be gone."""
    pids = processes_with_env(name, value)
    for pid in pids:
        _signal_pid(pid, first)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_running(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        if is_running(pid):
            _signal_pid(pid, signal.SIGKILL)
    return pids


def is_running(pid: int) -> bool:
    """True if `pid` exists and is neither a zombie nor dead."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _signal_pid(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

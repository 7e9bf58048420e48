"""The emulated WAN of one local run: each datacenter in its own Linux network namespace, every packet
between namespaces carried by the delay line (crossdc.wan.delay_line) through the emulated links.

Promises:
- the coordinator (SuperLink, ServerApp, database) stays in the root namespace and reaches the
  datacenters at :attr:`EmulatedNetwork.coordinator_address`; datacenter ``i`` has its own address and
  namespace, whose loopback is its fast intra-datacenter fabric;
- the run's address range (10.201.<slot>.0/24) has a blackhole route in the root namespace while the
  run holds it, so a packet for a namespace that is gone is dropped on this machine, never sent out;
- :meth:`EmulatedNetwork.close` removes every namespace, device, route and process of the run; a run
  that could not (its parent was SIGKILLed) is swept by the next :meth:`EmulatedNetwork.start` on this
  machine, which removes what dead runs left and only that (each run's slot file names its owner);
- faults: :meth:`cut` drops every packet of a link for a while and resets the TCP connections that
  cross it when the cut starts and when it ends; :meth:`reset` resets them only.
Where namespaces cannot be made, :func:`namespaces_unavailable` says why in one line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from crossdc.experiment.links import LinkSpec
from crossdc.experiment.processes import die_with_parent, enter_network_namespace, process_start, same_process_alive
from crossdc.wan.topology import COORDINATOR, mesh_hops, star_hops

log = logging.getLogger("crossdc.wan")

#: the emulator's addresses: one /24 per concurrent run, 10.201.<slot>.0/24
NETWORK_PREFIX = "10.201"
SLOTS = 256
DEFAULT_MTU = 65_000
STATE_ROOT = Path("/run/crossdc-wan")
READY_TIMEOUT_S = 30.0
#: a cut the coordinator does not end (it died) ends by itself this much after its time
CUT_GRACE_S = 5.0


class NamespacesUnavailable(RuntimeError):
    """This machine cannot run the namespace emulator (the message says why)."""


def namespaces_unavailable() -> str | None:
    """None if network namespaces, TUN devices and netlink can be used here, else the reason in one line."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root, or the relay emulates Flower's traffic only"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun: the kernel offers no TUN devices"
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "pyroute2 is not installed"
    return None


def owner_state(pid: int) -> dict[str, Any]:
    """How a slot file names the run's owner: its pid and its start time (processes.process_start: a recycled pid is
    not the owner), the start as text as slot files have always had it (None if `pid` is gone)."""
    start = process_start(pid)
    return {"pid": pid, "pid_start": None if start is None else str(start)}


def _owner_alive(state: dict[str, Any]) -> bool:
    """Whether the owner a slot file names (:func:`owner_state`) still runs; False for a malformed one."""
    try:
        return same_process_alive(int(state["pid"]), int(state["pid_start"]))
    except (KeyError, TypeError, ValueError):
        return False


def _remove_run(state: dict[str, Any]) -> None:
    """Remove what one run holds: the processes in its namespaces, the namespaces, its blackhole route."""
    from pyroute2 import IPRoute, netns

    existing = set(netns.listnetns())
    for name in state.get("namespaces", []):
        if name not in existing:
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        try:
            netns.remove(name)
        except OSError as err:
            log.warning("could not remove network namespace %s: %s", name, err)
    if not state.get("network"):
        return
    with IPRoute() as ipr:
        try:
            ipr.route("del", dst=state["network"], type="blackhole")
        except Exception:  # noqa: BLE001 - already gone
            pass


def sweep(state_root: Path = STATE_ROOT) -> list[str]:
    """Remove what runs whose owner died left behind (namespaces, routes, processes); returns their slot files."""
    swept = []
    if not state_root.is_dir():
        return swept
    for path in sorted(state_root.glob("slot-*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if _owner_alive(state):
            continue
        _remove_run(state)
        (state_root / path.name.replace("slot-", "spec-")).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        swept.append(path.name)
    return swept


class EmulatedNetwork:
    """The namespaces, devices and delay line of one run (see the module docstring)."""

    def __init__(self, star: Sequence[tuple[str, LinkSpec | None]], mesh: Sequence[tuple[str, str, LinkSpec]],
                 ledger_dir: Path, *, mtu: int = DEFAULT_MTU, seed: int = 0, state_root: Path = STATE_ROOT,
                 log_path: Path | None = None) -> None:
        reason = namespaces_unavailable()
        if reason is not None:
            raise NamespacesUnavailable(reason)
        self.star = list(star)
        self.mesh = list(mesh)
        self.names = [name for name, _ in self.star]
        self.ledger_dir = ledger_dir
        self.mtu = mtu
        self.seed = seed
        self.state_root = state_root
        self.log_path = log_path
        self.slot: int | None = None
        self.process: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None
        #: what this run made (removed by close); a failed start removes only these
        self._created: list[str] = []
        self._blackhole = False
        self._lock = threading.Lock()
        self._timers: list[threading.Timer] = []

    # --------------------------------------------------------------- addresses
    @property
    def network(self) -> str:
        return f"{NETWORK_PREFIX}.{self.slot}.0/24"

    @property
    def coordinator_address(self) -> str:
        return f"{NETWORK_PREFIX}.{self.slot}.1"

    def address(self, datacenter: str) -> str:
        return f"{NETWORK_PREFIX}.{self.slot}.{10 + self.names.index(datacenter)}"

    def namespace(self, datacenter: str) -> str:
        return f"cdc{self.slot}-{self.names.index(datacenter) + 1}"

    def device(self, datacenter: str) -> str:
        """The name of the datacenter's emulated interface inside its namespace (e.g. for GLOO_SOCKET_IFNAME)."""
        return f"cdc{self.slot}d{self.names.index(datacenter) + 1}"

    def namespace_path(self, datacenter: str) -> Path:
        return Path("/run/netns") / self.namespace(datacenter)

    def preexec(self, datacenter: str) -> Callable[[], None]:
        """For subprocess: run the child in the datacenter's namespace (and stop it when the starter dies)."""
        path = str(self.namespace_path(datacenter))

        def enter() -> None:
            enter_network_namespace(path)
            die_with_parent()

        return enter

    # ------------------------------------------------------------------ set-up
    def start(self) -> EmulatedNetwork:
        from pyroute2 import IPRoute, netns

        swept = sweep(self.state_root)
        if swept:
            log.warning("removed what %d earlier run(s) left behind: %s", len(swept), ", ".join(swept))
        self._claim_slot()
        try:
            with IPRoute() as ipr:
                ipr.route("add", dst=self.network, type="blackhole")
            self._blackhole = True
            for name in self._state()["namespaces"]:
                netns.create(name)
                self._created.append(name)
            self._start_delay_line()
        except BaseException:
            self.close()
            raise
        return self

    def _claim_slot(self) -> None:
        """The lowest slot free in `state_root` whose names (namespaces, device, route) nobody on this machine uses."""
        from pyroute2 import IPRoute, netns

        self.state_root.mkdir(parents=True, exist_ok=True)
        namespaces = set(netns.listnetns())
        with IPRoute() as ipr:
            devices = {link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
            routes = {f"{route.get_attr('RTA_DST')}/{route['dst_len']}" for route in ipr.get_routes(family=2)}
        for slot in range(SLOTS):
            if (f"cdc{slot}" in devices or f"{NETWORK_PREFIX}.{slot}.0/24" in routes
                    or any(name.startswith(f"cdc{slot}-") for name in namespaces)):
                continue  # another state folder's run (or what a dead one left) holds these names
            path = self.state_root / f"slot-{slot}.json"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                continue
            self.slot = slot
            with os.fdopen(fd, "w") as handle:
                json.dump(self._state(), handle)
            return
        raise RuntimeError(f"all {SLOTS} emulator slots are taken (see {self.state_root})")

    def _state(self) -> dict[str, Any]:
        return {**owner_state(os.getpid()), "network": self.network,
                "namespaces": [self.namespace(name) for name in self.names]}

    def _spec(self) -> dict[str, Any]:
        nodes = [{"device": f"cdc{self.slot}", "address": self.coordinator_address, "netns": None}]
        nodes += [{"device": self.device(name), "address": self.address(name), "netns": self.namespace(name)}
                  for name in self.names]
        return {"nodes": nodes, "network": self.network, "mtu": self.mtu, "seed": self.seed,
                "ledger_dir": str(self.ledger_dir),
                "star": [[name, dataclasses.asdict(link) if link else None] for name, link in self.star],
                "mesh": [[a, b, dataclasses.asdict(link)] for a, b, link in self.mesh]}

    def _start_delay_line(self) -> None:
        assert self.slot is not None
        spec_path = self.state_root / f"spec-{self.slot}.json"
        spec_path.write_text(json.dumps(self._spec()))
        self._log = open(self.log_path, "a") if self.log_path else None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "crossdc.wan.delay_line", str(spec_path)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log or subprocess.DEVNULL, text=True, preexec_fn=die_with_parent,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], READY_TIMEOUT_S)
        line = self.process.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.process.kill()
            raise RuntimeError(f"the delay line did not start within {READY_TIMEOUT_S:.0f} s (code {self.process.poll()}); "
                               f"see {self.log_path or 'its stderr'}")

    # ------------------------------------------------------------------ faults
    def cut(self, seconds: float, datacenter: str | None = None, between: tuple[str, str] | None = None) -> None:
        """Drop every packet of the datacenter's star link (or of the mesh link `between`) for `seconds`; reset the
        connections that cross it now and when the cut ends."""
        hops = list(star_hops(datacenter) if datacenter else mesh_hops(*between))  # type: ignore[misc]
        # the delay line holds the cut until told to restore (or CUT_GRACE_S later): the reset at the end comes first,
        # so a connection opened as the link returns is never caught by it
        self._control({"op": "cut", "hops": hops, "seconds": seconds + CUT_GRACE_S})
        self.reset(datacenter=datacenter, between=between)

        def restore() -> None:
            self.reset(datacenter=datacenter, between=between)
            try:
                self._control({"op": "restore", "hops": hops})
            except RuntimeError:  # the network was closed meanwhile
                pass

        timer = threading.Timer(seconds, restore)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def reset(self, datacenter: str | None = None, between: tuple[str, str] | None = None) -> None:
        """Reset (RST, both ends) every TCP connection across the datacenter's star link or the mesh link `between`."""
        if datacenter is not None:
            ends = [(self.namespace(datacenter), self.coordinator_address), (None, self.address(datacenter))]
        else:
            assert between is not None
            a, b = between
            ends = [(self.namespace(a), self.address(b)), (self.namespace(b), self.address(a))]
        for namespace, peer in ends:
            command = ["ss", "-K", "dst", peer] if namespace is None else ["ss", "-N", namespace, "-K", "dst", peer]
            subprocess.run(command, capture_output=True, timeout=10)

    def stats(self) -> dict[str, Any]:
        """Per-hop counters from the delay line (packets, bytes, drops by cause) and its CPU seconds."""
        return self._control({"op": "stats"})

    def _control(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError("the delay line is not running")
            assert self.process.stdin is not None and self.process.stdout is not None
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            answer: dict[str, Any] = json.loads(self.process.stdout.readline())
        if "error" in answer:
            raise RuntimeError(f"delay line: {answer['error']}")
        return answer

    # ----------------------------------------------------------------- removal
    def close(self) -> None:
        """Stop the delay line and remove the run's namespaces (with any process left in them), devices and routes."""
        for timer in self._timers:
            timer.cancel()
        if self.process is not None:
            if self.process.poll() is None:
                try:
                    assert self.process.stdin is not None
                    self.process.stdin.close()
                    self.process.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    self.process.kill()
                    self.process.wait(timeout=5)
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    stream.close()
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.slot is not None:
            _remove_run({**self._state(), "namespaces": self._created, "network": self.network if self._blackhole else None})
            self._created, self._blackhole = [], False
            (self.state_root / f"spec-{self.slot}.json").unlink(missing_ok=True)
            (self.state_root / f"slot-{self.slot}.json").unlink(missing_ok=True)
            self.slot = None

    def __enter__(self) -> EmulatedNetwork:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["COORDINATOR", "DEFAULT_MTU", "EmulatedNetwork", "NamespacesUnavailable", "namespaces_unavailable", "sweep"]

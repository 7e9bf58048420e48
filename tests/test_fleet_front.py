"""The Fleet API front: SuperNodes reach a private SuperLink through it over TLS; the Control API is refused.

The SuperLink and the front run in the root namespace, the SuperNodes in a datacenter's network namespace behind
crossdc's WAN emulator (tests/namespaced.py): they reach the front on the emulator's coordinator address only."""

from __future__ import annotations

import ssl
import sys
import time
from pathlib import Path

import httpx
import pytest
from namespaced import DATACENTER_ENV, crossed, emulated_datacenters, ledger_size, needs_namespaces

from crossdc.deployment.fleet_front import is_fleet_request, start_front
from crossdc.deployment.tls import make_certificates
from crossdc.experiment.links import LINK_PROFILES
from crossdc.experiment.processes import ProcessGroup, flower_env, free_port, wait_for_port
from crossdc.wan.network import EmulatedNetwork

BIN = Path(sys.executable).parent
DATACENTER = "us-east"
#: slots of this module's emulated WANs (see tests/namespaced.py)
SLOT_BASE = 170


def test_only_fleet_posts_pass() -> None:
    assert is_fleet_request("POST", "/v1/fleet/pull-messages")
    assert not is_fleet_request("GET", "/v1/fleet/pull-messages")
    assert not is_fleet_request("POST", "/v1/control/start-run")
    assert not is_fleet_request("POST", "/v1/fleet/")
    assert not is_fleet_request("POST", "/v1/fleet/../control/start-run")
    assert not is_fleet_request("POST", "/v1/serverappio/pull-messages")


@pytest.mark.deployment
@needs_namespaces
def test_supernode_joins_through_the_front_and_control_api_is_refused(tmp_path: Path) -> None:
    with emulated_datacenters(tmp_path, [(DATACENTER, LINK_PROFILES["metro"])], SLOT_BASE) as net:
        crossed_link = _front_and_supernodes(tmp_path, net)
    # the SuperNode's requests and the front's answers crossed the datacenter's emulated link, packet by packet
    assert crossed_link["up"] > 0 and crossed_link["down"] > 0, crossed_link
    assert ledger_size(net, DATACENTER) > 0


def _front_and_supernodes(tmp_path: Path, net: EmulatedNetwork) -> dict[str, int]:
    # the front's certificate names the address the datacenters reach it at
    certs = make_certificates(tmp_path / "certs", [net.coordinator_address])
    env = flower_env(tmp_path / "flwr")
    datacenter = {"env": {**env, **DATACENTER_ENV}, "preexec": net.preexec(DATACENTER)}
    processes = ProcessGroup()
    private_port, front_port = free_port(), free_port()
    front = None
    try:
        superlink = processes.start("superlink", [str(BIN / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                                                  "--host", "127.0.0.1", "--port", str(private_port)],
                                    tmp_path / "superlink.log", env=env)
        wait_for_port("127.0.0.1", private_port, 60, alive=superlink)
        front = start_front(f"http://127.0.0.1:{private_port}", net.coordinator_address, front_port, certs.server_cert, certs.server_key)
        with httpx.Client(verify=ssl.create_default_context(cafile=str(certs.ca_cert)), timeout=10) as client:
            refused = client.post(f"{front.url}/v1/control/list-runs", content=b"", headers={"content-type": "application/protobuf"})
            assert refused.status_code == 403 and "Fleet API" in refused.json()["detail"]
            assert client.get(f"{front.url}/docs").status_code == 403
        # the same Control API call is answered (not 403, not 404) when made directly: the front is what refuses it
        direct = httpx.post(f"http://127.0.0.1:{private_port}/v1/control/list-runs", content=b"",
                            headers={"content-type": "application/protobuf"}, timeout=10)
        assert direct.status_code not in (403, 404)
        assert front.stats.refused[("POST", "/v1/control/list-runs")] == 1
        processes.start("supernode", [str(BIN / "flower-supernode"), "--root-certificates", str(certs.ca_cert),
                                      "--superlink", f"{net.coordinator_address}:{front_port}", "--port", str(free_port())],
                        tmp_path / "supernode.log", **datacenter)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(path.endswith("activate-node") and status == 200 for path, status in front.stats.forwarded):
                break
            time.sleep(0.2)
        log = (tmp_path / "supernode.log").read_text(errors="replace")
        assert any(path.endswith("activate-node") and status == 200 for path, status in front.stats.forwarded), log[-2000:]
        # a SuperNode that does not trust crossdc's CA never gets a request through
        before = sum(front.stats.forwarded.values())
        stranger = processes.start("stranger", [str(BIN / "flower-supernode"), "--superlink",
                                                f"{net.coordinator_address}:{front_port}", "--port", str(free_port()),
                                                "--max-retries", "1"],
                                   tmp_path / "stranger.log", **datacenter)
        refused_tls = False
        deadline = time.monotonic() + 60
        while not refused_tls and time.monotonic() < deadline:
            time.sleep(0.5)
            stranger_log = (tmp_path / "stranger.log").read_text(errors="replace")
            refused_tls = "certificate verify failed" in stranger_log.lower()
        assert refused_tls, stranger_log[-2000:]
        polls = sum(n for (path, _), n in front.stats.forwarded.items())
        # only the trusted node's polls moved the counter (at most a few per second)
        assert polls - before < 60
        del stranger
        return crossed(net, DATACENTER)
    finally:
        if front is not None:
            front.stop()
        processes.stop_all()

"""Deployment tests' datacenters in network namespaces behind crossdc's packet-level WAN emulator (crossdc.wan.network),
as local runs put them: the operator's processes stay in the root namespace and listen on the emulator's coordinator
address; each datacenter's processes start in its own namespace (`net.preexec(name)`) and reach the operator only
across their emulated link.

The emulator keeps its state under the test's tmp_path, from a slot of the test module's own (`slot_base` up; the
slots below hold placeholders owned by this process): slots are counted per state folder while the names they stand
for (cdc<slot>-<i>, 10.201.<slot>.0/24) are machine-wide, so runs of the suite that start at slot 0 (and the emulator's
own tests, from 200) never race these for the same names."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from crossdc.experiment.links import LinkSpec
from crossdc.wan.network import EmulatedNetwork, owner_state

#: for tests whose datacenters run in namespaces: skipped, with the reason, where namespaces cannot be made (failed
#: under CI; conftest's `namespaces` fixture)
needs_namespaces = pytest.mark.usefixtures("namespaces")

#: what a datacenter's processes need in their namespace besides the operator's environment: gloo (the trainers' DDP
#: worker group) on the namespace's loopback, the datacenter's own fabric (as local runs do)
DATACENTER_ENV = {"GLOO_SOCKET_IFNAME": "lo"}


@contextlib.contextmanager
def emulated_datacenters(tmp_path: Path, star: Sequence[tuple[str, LinkSpec | None]],
                         slot_base: int) -> Iterator[EmulatedNetwork]:
    """The emulated WAN of `star` (datacenter, link) with its ledgers in tmp_path/ledgers, its state in tmp_path/wan
    and the delay line's log in tmp_path/delay-line.log; removed (with every process left in its namespaces) after."""
    state_root = tmp_path / "wan"
    state_root.mkdir(parents=True, exist_ok=True)
    mine = {**owner_state(os.getpid()), "network": "0.0.0.0/32", "namespaces": []}
    for slot in range(slot_base):
        (state_root / f"slot-{slot}.json").write_text(json.dumps(mine))
    with EmulatedNetwork(star, [], tmp_path / "ledgers", state_root=state_root,
                         log_path=tmp_path / "delay-line.log") as net:
        yield net


def crossed(net: EmulatedNetwork, datacenter: str) -> dict[str, int]:
    """Packets the delay line carried on the datacenter's star link so far, by direction ("up": to the operator)."""
    hops = net.stats()["hops"]
    return {direction: int(hops[f"{datacenter}:{direction}"]["packets"]) for direction in ("up", "down")}


def ledger_size(net: EmulatedNetwork, datacenter: str) -> int:
    """Bytes in the datacenter's link ledger (one line per packet that crossed its link); 0 if there is none."""
    path = net.ledger_dir / f"{datacenter}.ledger"
    return path.stat().st_size if path.exists() else 0

"""Which emulator a local run uses: the namespace emulator where it can run; elsewhere the relay (Flower's traffic
only), said in one line, and a clear refusal for what only the namespace emulator can do."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest

from crossdc.experiment.config import parse_config
from crossdc.orchestration import local_run
from crossdc.orchestration.local_run import EMULATOR_NAMESPACES, EMULATOR_RELAY, LocalRun, LocalRunOptions, RunFailed

STAR = """
[run]
name = "choice"
rounds = 1

[workload]
dataset = "digits"
batch_size = 16

[strategy]
name = "fedavg"

[[datacenters]]
name = "dc-a"
link = "transoceanic"

[[datacenters]]
name = "dc-b"
"""
MESH = STAR + """
[[links]]
between = ["dc-a", "dc-b"]
profile = "metro"
"""


def run_of(text: str, tmp_path: Path) -> LocalRun:
    return LocalRun(parse_config(tomllib.loads(text)), LocalRunOptions(db_url=f"sqlite:///{tmp_path / 'x.db'}", runs_root=tmp_path))


def test_without_namespaces_a_star_falls_back_to_the_relay_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(local_run, "namespaces_unavailable", lambda: "network namespaces need root (test)")
    with caplog.at_level(logging.WARNING, logger="crossdc.local_run"):
        assert run_of(STAR, tmp_path)._choose_emulator() == EMULATOR_RELAY
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "relay" in said[0] and "need root (test)" in said[0]


def test_without_namespaces_a_mesh_is_refused_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_run, "namespaces_unavailable", lambda: "no /dev/net/tun (test)")
    with pytest.raises(RunFailed, match=r"datacenter-to-datacenter links need the namespace emulator.*no /dev/net/tun \(test\)"):
        run_of(MESH, tmp_path)._choose_emulator()


@pytest.mark.usefixtures("namespaces")
def test_with_namespaces_every_run_uses_them(tmp_path: Path) -> None:
    assert run_of(STAR, tmp_path)._choose_emulator() == EMULATOR_NAMESPACES
    assert run_of(MESH, tmp_path)._choose_emulator() == EMULATOR_NAMESPACES

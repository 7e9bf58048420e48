"""The sync-dp baseline: torch DistributedDataParallel (gloo) across the datacenters' namespaces, its all-reduce over
the emulated WAN at every step, logged as a baseline with per-datacenter compute_s and comm_s from the delay line."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import crossdc_executable

from crossdc.clients.local_training import BatchStream
from crossdc.clients.sync_dp_rank import CommunicationTimer
from crossdc.db.engine import make_engine
from crossdc.db.queries import get_run, list_datacenter_rounds, list_rounds
from crossdc.experiment.builders import build_workload, datacenter_seed, initial_model
from crossdc.experiment.config import parse_config
from crossdc.wan.ledger import Transfer, bytes_of_datacenter

CONFIG = """
[run]
name = "sync-dp-test"
rounds = 3
seed = 3

[workload]
dataset = "digits"
model = "mlp"
model_args = { hidden = 16, layers = 1 }
batch_size = 16
optimizer = "sgd"
lr = 0.1

[strategy]
name = "fedavg"
tau = 3

[[datacenters]]
name = "dc-a"
link = { bandwidth_mbps = 100, rtt_ms = 10 }

[[datacenters]]
name = "dc-b"
link = { bandwidth_mbps = 100, rtt_ms = 10 }

[[links]]
between = ["dc-a", "dc-b"]
bandwidth_mbps = 100
rtt_ms = 150
"""


def test_communication_timer_counts_overlapping_all_reduces_once() -> None:
    timer = CommunicationTimer()
    timer.intervals += [(0.0, 1.0), (0.5, 1.5), (3.0, 4.0)]
    assert timer.take_waiting_s() == pytest.approx(2.5)
    assert timer.take_waiting_s() == 0.0


def test_bytes_of_a_datacenter_from_its_star_and_mesh_ledgers() -> None:
    transfers = [Transfer("up", 10, 0, 1), Transfer("down", 20, 0, 1), Transfer("dc-a>dc-b", 30, 0, 1), Transfer("dc-b>dc-a", 40, 0, 1)]
    assert bytes_of_datacenter(transfers, "dc-a") == {"up": 40, "down": 60}
    assert bytes_of_datacenter(transfers, "dc-b") == {"up": 50, "down": 50}


def reference_weights(config_text: str) -> dict[str, np.ndarray]:
    """Single-process training on the concatenated per-datacenter batches: each datacenter's batch drawn from its own
    shard in its own order (as in the federation), one SGD step on their union per step."""
    config = parse_config(tomllib.loads(config_text))
    workload = build_workload(config)
    model = initial_model(config, workload)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.workload.lr)
    streams = [BatchStream(workload.shard(name), config.workload.batch_size, datacenter_seed(config, name))
               for name in config.datacenter_names]
    for _ in range(config.run.rounds * 3):
        batches = [stream.next() for stream in streams]
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        workload.loss(model(inputs), targets).backward()
        optimizer.step()
    return {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}


@pytest.mark.deployment
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("namespaces")
def test_sync_dp_all_reduces_over_the_emulated_wan_and_trains_the_concatenated_batches(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(CONFIG)
    db_url = f"sqlite:///{tmp_path / 'runs.db'}"
    completed = subprocess.run([crossdc_executable(), "run", "config.toml", "--baseline", "sync-dp", "--db", db_url, "--json"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    assert summary["baseline"] == "sync-dp" and summary["steps"] == 9 and summary["ranks"] == 2
    engine = make_engine(db_url)
    try:
        run = get_run(engine, summary["run_id"])
        assert run is not None and run["baseline"] == "sync-dp" and run["status"] == "finished"
        rounds = list_rounds(engine, summary["run_id"])
        assert [r["round"] for r in rounds] == [1, 2, 3] and rounds[-1]["val_loss"] is not None
        rows = list_datacenter_rounds(engine, summary["run_id"])
    finally:
        engine.dispose()
    assert len(rows) == 6 and all(r["comm_source"] == "delay-line" and r["compute_s"] > 0 for r in rows)
    for name in ("dc-a", "dc-b"):
        mine = [r for r in rows if r["datacenter"] == name]
        # every step's all-reduce waits at least one round trip of the 150 ms datacenter-to-datacenter link
        assert sum(r["comm_s"] for r in mine) >= 0.9 * 9 * 0.150, mine
        assert all(r["link_bytes_up"] > 0 and r["link_bytes_down"] > 0 for r in mine)
    final = dict(np.load(summary["final_weights"]))
    expected = reference_weights(CONFIG)
    assert set(final) == set(expected)
    for name, tensor in expected.items():
        np.testing.assert_allclose(final[name], tensor, rtol=1e-5, atol=1e-6, err_msg=name)

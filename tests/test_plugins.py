"""A third-party plug-in package (examples/plugins/crossdc-fedavgm): pip-installed, its strategy and workload are
found through the entry points like the built-ins, listed, and run end to end on the Deployment Engine (server and
trainers find them in their own processes).

The package is installed into a folder of its own (``pip install --target``) that only this module's processes
see (on their PYTHONPATH): the virtualenv itself never changes, so tests running at the same time in other
processes never meet a half-installed plug-in."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import read_run
from test_cli_errors import cli  # tests/ is on sys.path

from crossdc.experiment.processes import free_port

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "examples" / "plugins" / "crossdc-fedavgm"
PIP = [sys.executable, "-m", "pip"]


@dataclass(frozen=True)
class InstalledPlugin:
    """The example package as installed: its source folder, and the environment of a process that sees it."""

    source: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InstalledPlugin]:
    site = tmp_path_factory.mktemp("plugin-site")
    subprocess.run([*PIP, "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), str(PLUGIN)],
                   check=True, capture_output=True, timeout=300)
    try:
        path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
        yield InstalledPlugin(PLUGIN, {"PYTHONPATH": path})
    finally:
        for leftover in (*PLUGIN.glob("*.egg-info"), PLUGIN / "build"):
            shutil.rmtree(leftover, ignore_errors=True)


@pytest.mark.timeout(360)
def test_the_plugin_is_listed_with_its_parameters(installed_plugin: InstalledPlugin, tmp_path: Path) -> None:
    result = cli(["strategies", "list", "--json"], tmp_path, installed_plugin.env)
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    row = rows["fedavgm"]
    assert row["source"] == "plug-in" and row["class"] == "crossdc_fedavgm.strategy:FedAvgM"
    assert row["parameters"]["server_momentum"]["default"] == 0.9 and row["parameters"]["server_lr"]["type"] == "float"
    assert rows["fedavg"]["source"] == "built-in"
    # and the workload plug-in next to the built-ins
    listed = subprocess.run([sys.executable, "-c", "from crossdc.workloads import available_workloads as a; print(','.join(a()))"],
                            capture_output=True, text=True, timeout=300, check=True,
                            env={**os.environ, **installed_plugin.env}).stdout.strip().split(",")
    assert {"moons", "synthetic", "digits"} <= set(listed)


@pytest.mark.timeout(360)
def test_the_plugins_server_momentum_by_hand(installed_plugin: InstalledPlugin, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(installed_plugin.source))  # this process keeps its path: import from the source
    from crossdc_fedavgm.strategy import server_momentum_step

    w = {"w": np.array([1.0], np.float32)}
    x, v = server_momentum_step(w, {"w": np.array([2.0], np.float32)}, None, lr=0.5, momentum=0.9)
    assert x["w"][0] == pytest.approx(2.0) and v["w"][0] == pytest.approx(2.0)  # v = 2, x = 1 + 0.5·2
    x, v = server_momentum_step(x, {"w": np.array([1.0], np.float32)}, v, lr=0.5, momentum=0.9)
    assert v["w"][0] == pytest.approx(2.8) and x["w"][0] == pytest.approx(3.4)  # v = 0.9·2 + 1, x = 2 + 0.5·2.8


@pytest.mark.deployment
@pytest.mark.timeout(300)
def test_the_plugin_strategy_and_workload_run_on_the_deployment_engine(installed_plugin: InstalledPlugin,
                                                                       tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'plugin.db'}"
    bad = tmp_path / "bad.toml"
    bad.write_text((installed_plugin.source / "moons-fedavgm.toml").read_text().replace("server_momentum = 0.5", "server_momentum = true"))
    refused = cli(["run", str(bad), "--db", db_url, "--runs-dir", str(tmp_path / "runs")], tmp_path, installed_plugin.env)
    assert refused.returncode == 2 and "strategy 'fedavgm' parameter 'server_momentum' must be float" in refused.stderr
    result = cli(["run", str(installed_plugin.source / "moons-fedavgm.toml"), "--json", "--db", db_url,
                  "--port", str(free_port()), "--runs-dir", str(tmp_path / "runs")], tmp_path, installed_plugin.env,
                 timeout_s=280)  # a whole deployment run, on a machine shared with the rest of the suite
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    logged = read_run(db_url, summary["run_id"])
    assert logged["run"]["status"] == "finished" and logged["run"]["strategy"] == "fedavgm"
    assert [r["round"] for r in logged["rounds"]] == [1, 2, 3]
    assert all(r["status"] == "ok" for r in logged["dc_rounds"]) and len(logged["dc_rounds"]) == 6
    assert summary["val_accuracy"] > 0.7  # two moons are easy: it learned

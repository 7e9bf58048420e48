"""The layers of crossdc hold: imports run one way (the import-linter contract in pyproject.toml).

The contract is checked on the package as it is, and on a copy with one upward import added, which must fail:
a contract that cannot fail would guard nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=240)


def test_the_layers_contract_is_kept() -> None:
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(REPO / "crossdc", tmp_path / "crossdc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    gate = tmp_path / "crossdc" / "federation" / "update_gate.py"
    gate.write_text(gate.read_text() + "\nfrom crossdc.orchestration import local_run  # an upward import\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "crossdc.federation is not allowed to import crossdc.orchestration" in result.stdout
    assert "crossdc.federation.update_gate -> crossdc.orchestration.local_run" in result.stdout

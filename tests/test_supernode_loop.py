"""crossdc's SuperNode: flwr's own loop with its idle and reply waits shortened, and a loud refusal when flwr's loop
is not the one the shortening was written for."""

from __future__ import annotations

import importlib.util
import time
import types
from pathlib import Path

import pytest

from crossdc.clients import supernode


def fresh_copy_of_flowers_loop() -> types.ModuleType:
    """A private copy of flwr's SuperNode loop module (patching it leaves the real one alone)."""
    spec = importlib.util.find_spec(supernode.LOOP_MODULE)
    assert spec is not None and spec.origin is not None
    copy_spec = importlib.util.spec_from_file_location("copy_of_start_client_internal", spec.origin)
    assert copy_spec is not None and copy_spec.loader is not None
    module = importlib.util.module_from_spec(copy_spec)
    copy_spec.loader.exec_module(module)
    return module


def test_the_installed_flwr_loop_is_the_one_the_waits_were_written_for() -> None:
    """Fails when flwr's SuperNode loop changes: review crossdc.clients.supernode then."""
    import inspect

    module = importlib.import_module(supernode.LOOP_MODULE)
    assert supernode.sleeps_in_source(inspect.getsource(module)) == supernode.KNOWN_SLEEPS
    assert "time.sleep(3)" in inspect.getsource(module.start_client_internal)  # the idle poll, in the loop itself
    assert "time.sleep(0.5)" in inspect.getsource(module._push_messages)  # the wait for the ClientApp's reply


def test_the_patched_loop_waits_less_and_keeps_every_other_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fresh_copy_of_flowers_loop()
    supernode.patch_supernode_loop(module)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    module.time.sleep(3)
    module.time.sleep(0.5)
    module.time.sleep(1.25)
    assert slept == [supernode.IDLE_POLL_S, supernode.REPLY_POLL_S, 1.25]
    assert module.time.monotonic is time.monotonic  # everything else is the time module's own


def load_module(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_changed_loop_is_refused(tmp_path: Path) -> None:
    renamed = fresh_copy_of_flowers_loop()
    renamed.time = types.SimpleNamespace()  # the loop no longer uses the time module by that name
    with pytest.raises(supernode.FlowerLoopChanged, match="review crossdc.clients.supernode"):
        supernode.patch_supernode_loop(renamed)
    (tmp_path / "loop_v2.py").write_text("import time\n\ndef loop():\n    time.sleep(2)\n    time.sleep(0.5)\n")
    with pytest.raises(supernode.FlowerLoopChanged, match=r"sleeps \(2.0, 0.5\)"):
        supernode.patch_supernode_loop(load_module(tmp_path / "loop_v2.py"))
    assert supernode.sleeps_in_source("time.sleep(3)\ntime.sleep( 0.5 )\nother.sleep(1)") == (3.0, 0.5)


def test_a_crossdc_supernode_starts_as_flowers_does() -> None:
    import subprocess

    result = subprocess.run([*supernode.command(), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--superlink" in result.stdout and "usage: flower-supernode" in result.stdout

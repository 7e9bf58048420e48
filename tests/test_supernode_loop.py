"""crossdc's SuperNode: flwr's own loop with its idle and reply waits shortened, and a loud refusal when flwr's loop
is not the one the shortening was written for."""

from __future__ import annotations

import importlib.util
import time
import types
from pathlib import Path
from typing import Any

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


def test_the_patched_loop_gives_up_on_a_message_whose_objects_never_come(monkeypatch: pytest.MonkeyPatch) -> None:
    """A coordinator that died while uploading a message must not hold the node for the SuperLink's 180 s: the
    patched loop's pull of the message's objects (flwr's own pull_objects) gives up after the bound, and still
    waits, retrying soon, for objects that are merely late."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectUnavailableError

    module = fresh_copy_of_flowers_loop()
    supernode.patch_supernode_loop(module)
    monkeypatch.setattr(supernode, "INSTRUCTION_PULL_MAX_S", 0.3)
    tries: dict[str, int] = {}

    def pull_object(object_id: str) -> bytes:
        tries[object_id] = tries.get(object_id, 0) + 1
        if object_id == "late" and tries[object_id] >= 3:
            return b"content"
        raise ObjectUnavailableError(object_id)

    assert module.pull_objects(["late"], pull_object_fn=pull_object) == {"late": b"content"}
    with pytest.raises(ObjectPullError, match="never"):
        module.pull_objects(["never"], pull_object_fn=pull_object)
    assert tries["never"] >= 3  # tried again within the bound (backoff from 0.05 s), then given up


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
    # a loop that already bounds its pull of a message's objects is not the one the bound was written for
    (tmp_path / "loop_v3.py").write_text(
        "import time\nfrom flwr.supercore.inflatable.inflatable_utils import pull_objects\n\ndef loop(ids, fn):\n"
        "    time.sleep(3)\n    time.sleep(0.5)\n    time.sleep(0.5)\n    return pull_objects(ids, fn, max_time=5)\n")
    with pytest.raises(supernode.FlowerLoopChanged, match="pull_objects"):
        supernode.patch_supernode_loop(load_module(tmp_path / "loop_v3.py"))


def test_a_crossdc_supernode_starts_as_flowers_does() -> None:
    import subprocess

    result = subprocess.run([*supernode.command(), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--superlink" in result.stdout and "usage: flower-supernode" in result.stdout


def test_the_installed_flwr_starts_its_processes_as_crossdc_expects() -> None:
    """Fails when flwr changes how its SuperNode starts the SuperExec, how the SuperExec starts a ClientApp, or what
    the package of its entry points imports: review crossdc.clients.supernode then."""
    import inspect

    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND, TaskType

    loop = importlib.import_module(supernode.LOOP_MODULE)
    assert f'"{supernode.SUPEREXEC}"' in inspect.getsource(loop) and "subprocess.Popen(command)" in inspect.getsource(loop)
    executor = importlib.import_module(supernode.CLIENTAPP_LAUNCH_MODULE)
    assert TASK_TYPE_TO_COMMAND[TaskType.CLIENT_APP] == supernode.CLIENTAPP
    assert "subprocess.Popen(" in inspect.getsource(executor) and executor.subprocess.__name__ == "subprocess"
    spec = importlib.util.find_spec(supernode.CLI_PACKAGE)
    assert spec is not None and spec.origin is not None
    assert supernode.cli_package_imports(Path(spec.origin).read_text()) == supernode.KNOWN_CLI_IMPORTS


def test_flowers_launches_start_crossdcs_processes_with_the_same_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    started: list[list[str]] = []
    monkeypatch.setattr(subprocess, "Popen", lambda args, *rest, **options: started.append(list(args)))
    loop = fresh_copy_of_flowers_loop()
    supernode.patch_launch(loop, supernode.SUPEREXEC, "source")
    loop.subprocess.Popen([supernode.SUPEREXEC, "--insecure", "--parent-pid", "7"])
    loop.subprocess.Popen(["something-else", "--flag"])  # any other command is started as it is
    assert started == [[*supernode.command(supernode.SUPEREXEC), "--insecure", "--parent-pid", "7"],
                       ["something-else", "--flag"]]
    assert started[0][1:4] == ["-m", "crossdc.clients.supernode", "--as"]
    assert loop.subprocess.DEVNULL is subprocess.DEVNULL  # everything else is the subprocess module's own
    with pytest.raises(ValueError, match="crossdc starts"):
        supernode.command("flwr-serverapp")


def test_a_changed_launch_or_package_is_refused(tmp_path: Path) -> None:
    (tmp_path / "launch_v2.py").write_text('import subprocess\n\ndef go():\n    subprocess.run(["flower-superexec"])\n')
    with pytest.raises(supernode.FlowerLoopChanged, match="no longer starts flower-superexec"):
        supernode.patch_launch(load_module(tmp_path / "launch_v2.py"), supernode.SUPEREXEC, "source")
    (tmp_path / "launch_v3.py").write_text('import subprocess\n\ndef go():\n    subprocess.Popen(["flower-superexec-2"])\n')
    with pytest.raises(supernode.FlowerLoopChanged):
        supernode.patch_launch(load_module(tmp_path / "launch_v3.py"), supernode.SUPEREXEC, "source")
    # a launch that keeps the process Popen returns would get crossdc's launcher's answer instead: refused
    (tmp_path / "launch_v4.py").write_text('import subprocess\n\ndef go():\n    p = subprocess.Popen(["flower-superexec"])\n')
    with pytest.raises(supernode.FlowerLoopChanged, match="keeps what it returns"):
        supernode.patch_launch(load_module(tmp_path / "launch_v4.py"), supernode.SUPEREXEC, "source")
    known = '"""Doc."""\n\nfrom .flower_supernode import flower_supernode\nfrom .flwr_clientapp import flwr_clientapp\n\n__all__ = ["x"]\n'
    assert supernode.cli_package_imports(known) == supernode.KNOWN_CLI_IMPORTS
    changed = supernode.cli_package_imports(known + "register_plugins()\n")
    assert changed != supernode.KNOWN_CLI_IMPORTS and "?" in changed


def test_a_clientapp_starts_without_the_supernodes_command_line() -> None:
    """crossdc's ClientApp process runs Flower's own flwr-clientapp (its usage, its options) without importing the
    SuperNode's command line, the costly half of flwr.supernode.cli."""
    import subprocess
    import sys

    probe = ("import runpy, sys\n"
             "sys.argv = ['supernode', '--as', 'flwr-clientapp', '--help']\n"
             "try:\n    runpy.run_module('crossdc.clients.supernode', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('loaded:', 'flwr.supernode.cli.flower_supernode' in sys.modules, 'flwr.supernode.cli.flwr_clientapp' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: flwr-clientapp" in result.stdout and "--runtime-api-address" in result.stdout
    assert "loaded: False True" in result.stdout
    refused = subprocess.run([*supernode.command()[:3], "--as", "flwr-serverapp"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--as takes flower-superexec or flwr-clientapp" in refused.stderr


@pytest.mark.timeout(180)
def test_the_fork_server_starts_flowers_clientapp_with_its_arguments() -> None:
    """The SuperExec's launcher: each ClientApp a new process forked from a server that imported it once, running
    Flower's own flwr_clientapp on the arguments Flower gave (here its usage, and its refusal of an unknown option)."""
    launch = supernode.ForkServerLaunch()
    shown, refused = launch(["--help"]), launch(["--no-such-option"])
    for process in (shown, refused):
        process.join(timeout=120)
    assert shown.exitcode == 0 and refused.exitcode == 2  # argparse: usage shown; an unknown option refused
    assert shown.pid != refused.pid


def _receive_on_a_node(module: types.ModuleType, confirm: Any) -> tuple[Any, Any, str, Any]:
    """One receipt by the loop module's ``_pull_and_store_message`` on a real (in-memory) node state and object store,
    of a train message of a run the node knows, its objects pulled from the message itself, confirmed by `confirm`:
    (what it returned, the node state, the message id, the object store)."""
    import dataclasses

    import numpy as np
    from flwr.app import Array, ArrayRecord, Metadata, RecordDict
    from flwr.app.message import make_message, remove_content_from_message
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.constant import TaskType
    from flwr.supercore.date import now
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    store = ObjectStoreFactory().store()
    state = InMemoryNodeState(store)
    state.set_node_id(7)
    run = dataclasses.replace(Run.create_empty(42), primary_task_type=TaskType.CLIENT_APP, fab_hash="fab")
    state.store_run(run)
    message = make_message(
        metadata=Metadata(run_id=42, message_id="", src_node_id=SUPERLINK_NODE_ID, dst_node_id=7,
                          reply_to_message_id="", group_id="4", created_at=now().timestamp(), ttl=3600.0,
                          message_type="train"),
        content=RecordDict({"arrays": ArrayRecord({"model": Array(np.ones((2, 3), dtype=np.float32))})}))
    message.metadata.__dict__["_message_id"] = message.object_id
    tree = get_object_tree(message)
    objects = {object_id: obj.deflate() for object_id, obj in get_all_nested_objects(message).items()}
    returned = module._pull_and_store_message(
        state=state, object_store=store, node_config={}, receive=lambda: (remove_content_from_message(message), tree),
        get_run=lambda run_id: run, get_fab=lambda fab_hash, run_id: None,
        pull_object=lambda run_id, object_id: objects[object_id], confirm_message_received=confirm,
        trusted_entities=None)
    return returned, state, message.metadata.message_id, store


def test_a_message_whose_run_stops_while_it_is_received_is_dropped() -> None:
    """The SuperLink answers the receipt's confirmation with "run not running" (the run was stopped meanwhile): the
    patched loop drops the message (nothing of it left on the node, its ClientApp task failed, so no ClientApp's reply
    to it can take the place of the next message's). Flower's own loop leaves it stored with a task to run."""
    from flwr.common.constant import Status, SubStatus
    from flwr.supercore.run import RunNotRunningException

    def confirm(run_id: int, message_id: str) -> None:
        raise RunNotRunningException(f"run {run_id} is not running")

    returned, state, message_id, store = _receive_on_a_node(fresh_copy_of_flowers_loop(), confirm)
    assert returned is None
    assert [m.metadata.message_id for m in state.get_messages_legacy(run_ids=[42])] == [message_id]  # Flower's: kept
    assert [t.status.status for t in state.get_tasks()] != [Status.FINISHED]

    module = fresh_copy_of_flowers_loop()
    supernode.patch_supernode_loop(module)
    returned, state, message_id, store = _receive_on_a_node(module, confirm)
    assert returned is None
    assert state.get_messages_legacy(run_ids=[42]) == []
    assert store.get(message_id) is None
    [task] = state.get_tasks()
    assert (task.status.status, task.status.sub_status) == (Status.FINISHED, SubStatus.FAILED)
    assert "the run stopped while its message was received" in task.status.details

    # a receipt whose run is running is untouched: stored, confirmed, its task waiting for its ClientApp
    confirmed: list[str] = []
    returned, state, message_id, store = _receive_on_a_node(module, lambda run_id, mid: confirmed.append(mid))
    assert returned == 42 and confirmed == [message_id]
    assert [m.metadata.message_id for m in state.get_messages_legacy(run_ids=[42])] == [message_id]
    assert [t.status.status for t in state.get_tasks()] == [Status.PENDING]


def _reply_loop_on_a_node(module: types.ModuleType) -> tuple[list[str], list[str]]:
    """Flower's loop functions of `module` on a real (in-memory) node state: the node received a message and holds
    two replies to it (its ClientApp's, and the error reply stored when that ClientApp's task expired); the loop sends
    after the receipt, then its next receipt finds nothing new while the reply to the node's next message comes in.
    (the ids of the replies sent after the first receipt, those sent by the idle receipt)."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, Message, Metadata, RecordDict
    from flwr.app.message import make_message
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.date import now
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    store = ObjectStoreFactory().store()
    state = InMemoryNodeState(store)
    state.set_node_id(7)

    def instruction(kind: str) -> Any:
        message = make_message(
            metadata=Metadata(run_id=42, message_id="", src_node_id=SUPERLINK_NODE_ID, dst_node_id=7,
                              reply_to_message_id="", group_id="1", created_at=now().timestamp(), ttl=3600.0,
                              message_type=kind),
            content=RecordDict({"arrays": ArrayRecord({"model": Array(np.ones((2, 3), dtype=np.float32))})}))
        module._insert_message(message, state, store)
        return message

    def reply(to: Any, value: float) -> str:
        answer = Message(RecordDict({"arrays": ArrayRecord({"model": Array(np.full(2, value, np.float32))})}),
                         reply_to=to)
        module._insert_message(answer, state, store)
        return str(answer.metadata.message_id)

    sent: list[str] = []

    def send(message: Any, tree: Any, runtime: float) -> tuple[set[str], str]:
        sent.append(message.metadata.message_id)
        return set(), "session"

    senders = {"state": state, "object_store": store, "send": send, "push_object": lambda *args: None}
    train = instruction("train")
    state.get_messages_legacy(is_reply=False)  # the ClientApp took it
    reply(train, 1.0), reply(train, 2.0)
    module._push_messages(**senders)
    after_receipt = list(sent)
    hello = instruction("query")
    state.get_messages_legacy(is_reply=False)
    reply(hello, 3.0)
    sent.clear()
    module._pull_and_store_message(
        state=state, object_store=store, node_config={}, receive=lambda: None, get_run=lambda run_id: None,
        get_fab=lambda fab_hash, run_id: None, pull_object=lambda run_id, object_id: b"",
        confirm_message_received=lambda run_id, message_id: None, trusted_entities=None)
    return after_receipt, list(sent)


def test_a_reply_left_behind_is_sent_when_no_new_message_comes() -> None:
    """A reply the node holds unsent after the loop's push (there, the next message's, which came after a second
    reply to an earlier message was sent in its place) goes out at the loop's next receipt that finds nothing new.
    Flower's own loop keeps it until yet another message comes: a resumed run's hello went unanswered that way."""
    flowers_receipt, flowers_idle = _reply_loop_on_a_node(fresh_copy_of_flowers_loop())
    assert len(flowers_receipt) == 2 and flowers_idle == []  # Flower's: both train replies, then the hello's kept

    module = fresh_copy_of_flowers_loop()
    supernode.patch_supernode_loop(module)
    receipt, idle = _reply_loop_on_a_node(module)
    assert len(receipt) == 2 and len(idle) == 1 and idle[0] not in receipt

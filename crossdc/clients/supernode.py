"""Flower's SuperNode as crossdc starts it: flwr 1.42's own ``flower-supernode``, with shorter waits in its loop
and a lighter start for each ClientApp.

flwr 1.42's SuperNode (``flwr/supernode/start_client_internal.py``) handles one message at a time: it pulls a
message, waits for the ClientApp's reply, pushes it, and pulls again. Two fixed waits in that loop cost every
message time that no network and no computation needs: a pull that finds nothing sleeps **3 s** before the next
one (so a message posted to an idle node waits 1.5 s on average, up to 3 s, before it is even seen), and the
ClientApp's reply is looked for every **0.5 s**. crossdc starts its SuperNodes through :func:`main`, which runs
Flower's own entry point unchanged except for those two waits: :data:`IDLE_POLL_S` and :data:`REPLY_POLL_S`.

Promises:

- :func:`main` behaves as ``flower-supernode`` with the same arguments, except for the two waits above (every
  other sleep of the loop keeps its length);
- the loop gives up on a message whose objects are still not on the SuperLink after :data:`INSTRUCTION_PULL_MAX_S`
  (its sender died while uploading it) and goes on to the next message, where flwr 1.42 waits until the SuperLink's
  push session expires (180 s: a resumed coordinator's hello sat behind a stopped attempt's half-sent message);
- a message whose run stops while the node receives it is dropped (deleted, its ClientApp task failed) rather than
  left stored, where flwr 1.42's loop would run a ClientApp for it whose reply displaces the next message's
  (:func:`_drop_messages_of_stopped_runs`);
- a reply the node holds unsent is sent as soon as the loop finds no new message, where flwr 1.42's loop sends replies
  only right after receiving a message, and sends whichever it finds first: a second reply to one message (a
  ClientApp's own beside the error reply the node stored when that ClientApp's task expired under load) took the
  place of the next message's, and a resumed run's hello went unanswered (:func:`_send_replies_left_behind`);
- a SuperLink that does not answer (restarting, its host rebooting) is tried again at most
  :data:`RECONNECT_MAX_WAIT_S` apart, where flwr 1.42's backoff grows to 20 s: a SuperLink back from a restart is
  found within seconds (:func:`shorten_reconnect_wait`); the SuperNode never gives up (no ``--max-retries``);
- with :data:`PULSE_ENV` set, the SuperNode touches that file whenever the SuperLink answered it as this node (a pull
  of messages, or Flower's node heartbeat acknowledged), at most every :data:`PULSE_EVERY_S`: the file's age is how
  long ago the SuperLink last accepted it (``crossdc node health`` reads it; :func:`record_pulse`);
- :func:`patch_supernode_loop` refuses, with :class:`FlowerLoopChanged`, to patch a loop that is not the one this
  was written against (the sleeps it shortens are not the ones it finds), so an upgrade of flwr fails loudly
  rather than silently bringing the 3-second poll back or shortening a wait that means something else.

An idle SuperNode then asks the SuperLink for work about every ``IDLE_POLL_S`` plus a round trip; each such pull
is a small request (a few hundred bytes each way), which the link ledger does not count as payload.

**A lighter ClientApp start.** Every message starts a new ClientApp process: the SuperNode starts Flower's SuperExec
(``flower-superexec``), which starts ``flwr-clientapp`` per message. Flower's ``flwr-clientapp`` entry point imports
the package ``flwr.supernode.cli``, whose ``__init__`` also imports the SuperNode's own command line and with it a
web server, an SQL object store and Alembic: about 1.5 s of CPU that a ClientApp never uses (3.1 s of imports
against 1.7 s without them, measured on the 2-core development machine), paid by every message, on a machine the
ClientApp shares with the datacenter's trainer. crossdc's SuperNode starts the SuperExec as
``python -m crossdc.clients.supernode --as flower-superexec`` (Flower's own entry point), which starts each ClientApp
as ``python -m crossdc.clients.supernode --as flwr-clientapp``: Flower's own ``flwr_clientapp`` function, imported
without that package ``__init__`` (:func:`clientapp_main`). Promises: the same processes with the same arguments
run the same Flower functions; :func:`patch_launch` and :func:`clientapp_main` refuse, with
:class:`FlowerLoopChanged`, a flwr whose launch code or package ``__init__`` is not the one this was written against.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: how long an idle SuperNode waits between two pulls that found nothing (flwr 1.42: 3 s)
IDLE_POLL_S = 0.2
#: how often the SuperNode looks for the ClientApp's reply, and for an object it is about to push (flwr 1.42: 0.5 s)
REPLY_POLL_S = 0.05
#: the module whose loop is patched, and the sleeps it is known to make, in source order (flwr 1.42.0)
LOOP_MODULE = "flwr.supernode.start_client_internal"
KNOWN_SLEEPS: tuple[float, ...] = (3.0, 0.5, 0.5)
#: flwr's wait → crossdc's
SHORTER_WAITS: dict[float, float] = {3.0: IDLE_POLL_S, 0.5: REPLY_POLL_S}
#: how long the SuperNode waits for a message's objects to be uploaded to the SuperLink before it drops the message
#: (flwr 1.42: up to 2 hours, in practice until the SuperLink's 180-s push session expires). The coordinator uploads
#: them to its SuperLink beside it right after the message itself; objects still missing after this long mean it died
#: while uploading (a coordinator killed, a run stopped), and waiting on longer only holds the node's next message
#: (a resumed attempt's hello) back
INSTRUCTION_PULL_MAX_S = 30.0
#: the first and the longest pause between two tries of an object not uploaded yet (flwr 1.42: 1 s and 10 s)
INSTRUCTION_PULL_BACKOFF_S = (0.05, 1.0)


class FlowerLoopChanged(RuntimeError):
    """flwr's SuperNode loop is not the one crossdc's shorter waits were written for."""


def sleeps_in_source(source: str) -> tuple[float, ...]:
    """The constant arguments of every ``time.sleep(...)`` call in `source`, in order (a non-constant one: nan)."""
    found = []
    for argument in re.findall(r"\btime\.sleep\(([^()]*)\)", source):
        try:
            found.append(float(argument))
        except ValueError:
            found.append(float("nan"))
    return tuple(found)


class _ShorterWaits(types.ModuleType):
    """Stands in for the ``time`` module inside flwr's loop module: the same module, with the known waits shortened."""

    def __init__(self, waits: dict[float, float]) -> None:
        super().__init__("time")
        self._waits = waits

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(self._waits.get(seconds, seconds))


def patch_supernode_loop(module: types.ModuleType | None = None) -> None:
    """Shorten the SuperNode loop's idle and reply waits (:data:`SHORTER_WAITS`) in `module` (default: flwr's).

    Raises :class:`FlowerLoopChanged` when the module's sleeps are not :data:`KNOWN_SLEEPS` or it does not use the
    ``time`` module by that name."""
    if module is None:
        import importlib

        module = importlib.import_module(LOOP_MODULE)
    source = inspect.getsource(module)
    found = sleeps_in_source(source)
    if found != KNOWN_SLEEPS or getattr(module, "time", None) is not time:
        raise FlowerLoopChanged(
            f"{module.__name__} sleeps {found}, crossdc knows {KNOWN_SLEEPS}: flwr's SuperNode loop changed; review "
            "crossdc.clients.supernode before using this flwr version")
    module.time = _ShorterWaits(SHORTER_WAITS)  # type: ignore[attr-defined]
    _bound_instruction_pull(module, source)
    _drop_messages_of_stopped_runs(module, source)
    _send_replies_left_behind(module, source)


class RunStoppedWhileReceiving(RuntimeError):
    """The run of a message the SuperNode was receiving stopped (Flower's ``RunNotRunningException``, raised as an
    ordinary exception so that the loop's cleanup of a failed receipt runs)."""


def _ordinary_when_stopped(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, raising :class:`RunStoppedWhileReceiving` where it raised flwr's ``RunNotRunningException``."""
    from flwr.supercore.run import RunNotRunningException

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except RunNotRunningException as err:
            raise RunStoppedWhileReceiving(f"the run stopped while its message was received ({err!r})") from None

    return call


def _drop_messages_of_stopped_runs(module: types.ModuleType, source: str) -> None:
    """Make the loop drop a message whose run stops while the node receives it, as it drops one whose objects could
    not be pulled: the message and its objects deleted from the node, its ClientApp task finished (failed, its token
    revoked, so a ClientApp already started for it cannot reply).

    In flwr 1.42 the SuperLink's "run not running" answer to the object pull or to the receipt's confirmation is a
    ``BaseException`` that passes the loop's cleanup (``except Exception``): the message stays stored with its task,
    the SuperExec runs a ClientApp for it, and that ClientApp's reply is the one the loop sends after receiving the
    *next* message (the loop sends whatever reply it finds first, and sends only after receiving), so the next
    message's reply is left unsent: a resumed run's hello went unanswered that way. FlowerLoopChanged unless the loop
    receives through ``_pull_and_store_message`` and passes it the confirmation by keyword."""
    original = getattr(module, "_pull_and_store_message", None)
    if getattr(original, "stopped_runs_dropped", False):
        return
    if (original is None or "confirm_message_received" not in inspect.signature(original).parameters
            or "confirm_message_received=confirm_message_received" not in source):
        raise FlowerLoopChanged(f"{module.__name__} no longer receives a message through _pull_and_store_message with "
                                "its confirmation by keyword: review crossdc.clients.supernode before using this flwr version")

    def pull_and_store_message(*args: Any, **kwargs: Any) -> Any:
        if "confirm_message_received" in kwargs:
            kwargs["confirm_message_received"] = _ordinary_when_stopped(kwargs["confirm_message_received"])
        return original(*args, **kwargs)

    pull_and_store_message.stopped_runs_dropped = True  # type: ignore[attr-defined]
    module._pull_and_store_message = pull_and_store_message  # type: ignore[attr-defined]


def _holds_unsent_reply(state: Any) -> bool:
    """Whether the node `state` (flwr's in-memory node state) holds a reply that no push has taken yet."""
    with state.lock_msg_store:
        return any(entry.message.metadata.reply_to_message_id and not entry.is_retrieved
                   for entry in state.msg_store.values())


def _send_replies_left_behind(module: types.ModuleType, source: str) -> None:
    """Make the loop, whenever its receipt finds no new message, send the replies the node holds unsent (with what it
    sent the last reply through) before it sleeps.

    flwr 1.42's loop sends only right after it received a message, and then sends whatever replies it finds: a reply
    that arrives after that push (the received message's own, when a second reply to an earlier message was found
    first) stays on the node until yet another message comes. FlowerLoopChanged unless the loop sends through
    ``_push_messages`` by keyword and the node state keeps its messages where :func:`_holds_unsent_reply` looks."""
    import functools

    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState, MessageEntry

    receive, push = getattr(module, "_pull_and_store_message", None), getattr(module, "_push_messages", None)
    if getattr(receive, "replies_left_behind_sent", False):
        return
    state_source = inspect.getsource(InMemoryNodeState.__init__)
    if (receive is None or push is None or not re.search(r"\b_push_messages\(\s*state=state,", source)
            or "self.msg_store" not in state_source or "self.lock_msg_store" not in state_source
            or "is_retrieved" not in MessageEntry.__dataclass_fields__):
        raise FlowerLoopChanged(f"{module.__name__} no longer sends replies through _push_messages by keyword from an "
                                "in-memory node state: review crossdc.clients.supernode before using this flwr version")
    last_push: dict[str, Any] = {}

    def push_messages(**kwargs: Any) -> Any:
        last_push.update(kwargs)
        return push(**kwargs)

    def pull_and_store_message(*args: Any, **kwargs: Any) -> Any:
        run_id = receive(*args, **kwargs)
        if run_id is None and last_push and _holds_unsent_reply(last_push["state"]):
            push(**last_push)
        return run_id

    functools.update_wrapper(pull_and_store_message, receive)
    pull_and_store_message.replies_left_behind_sent = True  # type: ignore[attr-defined]
    module._pull_and_store_message = pull_and_store_message  # type: ignore[attr-defined]
    module._push_messages = push_messages  # type: ignore[attr-defined]


def _bound_instruction_pull(module: types.ModuleType, source: str) -> None:
    """Make the loop's pull of a message's objects give up after :data:`INSTRUCTION_PULL_MAX_S` (the loop then drops
    the message, as Flower does when a pull fails, and goes on to the next), trying again sooner
    (:data:`INSTRUCTION_PULL_BACKOFF_S`). FlowerLoopChanged unless the loop calls Flower's ``pull_objects`` with no
    limits of its own."""
    from flwr.supercore.inflatable import inflatable_utils

    calls = re.findall(r"\bpull_objects\(([^()]*(?:\([^()]*\)[^()]*)*)\)", source)
    current = getattr(module, "pull_objects", None)
    if (len(calls) != 1 or any(limit in calls[0] for limit in ("max_time", "max_tries", "backoff"))
            or not (current is inflatable_utils.pull_objects or getattr(current, "bounded", False))):
        raise FlowerLoopChanged(f"{module.__name__} no longer pulls a message's objects with one unbounded call of "
                                "flwr's pull_objects: review crossdc.clients.supernode before using this flwr version")
    initial, cap = INSTRUCTION_PULL_BACKOFF_S

    pull_objects = _ordinary_when_stopped(inflatable_utils.pull_objects)

    def bounded_pull_objects(object_ids: list[str], pull_object_fn: Callable[[str], bytes]) -> dict[str, bytes]:
        return pull_objects(object_ids, pull_object_fn, max_time=INSTRUCTION_PULL_MAX_S, initial_backoff=initial,
                            backoff_cap=cap)

    bounded_pull_objects.bounded = True  # type: ignore[attr-defined]
    module.pull_objects = bounded_pull_objects  # type: ignore[attr-defined]


#: the module whose retries of the Fleet API's calls back off, and the longest pause it knows (flwr 1.42.0)
RETRY_MODULE = "flwr.supercore.retry.http_retry"
KNOWN_MAX_RETRY_DELAY = 20
#: the longest pause between two tries of a SuperLink that does not answer (flwr 1.42: 20 s)
RECONNECT_MAX_WAIT_S = 5


def shorten_reconnect_wait(module: types.ModuleType | None = None) -> None:
    """Cap the backoff of `module`'s (default: flwr's HTTP retry module) retries at :data:`RECONNECT_MAX_WAIT_S`.
    FlowerLoopChanged unless it makes its waits with ``exponential(max_delay=MAX_RETRY_DELAY)``, reading that name
    at each call, and it is :data:`KNOWN_MAX_RETRY_DELAY`."""
    if module is None:
        module = importlib.import_module(RETRY_MODULE)
    current = getattr(module, "MAX_RETRY_DELAY", None)
    if ("lambda: exponential(max_delay=MAX_RETRY_DELAY)" not in inspect.getsource(module)
            or current not in (KNOWN_MAX_RETRY_DELAY, RECONNECT_MAX_WAIT_S)):
        raise FlowerLoopChanged(f"{module.__name__} no longer backs off with exponential(max_delay=MAX_RETRY_DELAY) up to "
                                f"{KNOWN_MAX_RETRY_DELAY} s: review crossdc.clients.supernode before using this flwr version")
    module.MAX_RETRY_DELAY = RECONNECT_MAX_WAIT_S  # type: ignore[attr-defined]


#: the environment variable naming the SuperNode's pulse file (see :func:`record_pulse`); `crossdc node start` sets it
PULSE_ENV = "CROSSDC_SUPERNODE_PULSE"
#: the pulse file is written at most this often (an idle SuperNode pulls every IDLE_POLL_S)
PULSE_EVERY_S = 1.0
#: the calls of flwr's Fleet client whose answers are the pulse: the loop's pull, and Flower's node heartbeat (every
#: 30 s or less, also while the loop waits for a ClientApp's reply)
PULSE_CALLS = ("PullMessages", "SendNodeHeartbeat")


def record_pulse(path: Path) -> None:
    """Make the SuperNode touch `path` whenever the SuperLink answered one of :data:`PULSE_CALLS` for this node (a
    pull it accepted; a heartbeat it acknowledged), at most every :data:`PULSE_EVERY_S`. Calls that fail (the
    SuperLink away, this node's key refused) leave it alone, so its age is how long ago the SuperLink last accepted
    this SuperNode. FlowerLoopChanged if flwr's Fleet client no longer makes those calls."""
    from flwr.supernode.fleet_http_client import FleetHttpClient

    last = [0.0]

    def beat() -> None:
        now = time.monotonic()
        if now - last[0] >= PULSE_EVERY_S:
            last[0] = now
            path.write_text(f"{time.time():.3f}\n")

    for name in PULSE_CALLS:
        call = getattr(FleetHttpClient, name, None)
        if call is None:
            raise FlowerLoopChanged(f"flwr's FleetHttpClient has no {name}: review crossdc.clients.supernode's pulse "
                                    "before using this flwr version")
        if getattr(call, "pulse", False):
            continue

        def answered(self: Any, request: Any, *, _call: Callable[..., Any] = call) -> Any:
            response = _call(self, request)
            if getattr(response, "success", True):  # a heartbeat the SuperLink did not acknowledge is no pulse
                beat()
            return response

        answered.pulse = True  # type: ignore[attr-defined]
        setattr(FleetHttpClient, name, answered)


#: Flower's processes crossdc starts in their place: the SuperNode starts the SuperExec by this name (in its loop
#: module), the SuperExec a ClientApp by that one (in its subprocess executor)
SUPEREXEC = "flower-superexec"
CLIENTAPP = "flwr-clientapp"
CLIENTAPP_LAUNCH_MODULE = "flwr.supercore.superexec.executor.subprocess_executor"
#: the package of flwr's SuperNode entry points, and the names its ``__init__`` imports (flwr 1.42.0)
CLI_PACKAGE = "flwr.supernode.cli"
KNOWN_CLI_IMPORTS: dict[str, tuple[str, ...]] = {"flower_supernode": ("flower_supernode",),
                                                 "flwr_clientapp": ("flwr_clientapp",)}
#: the option that picks which of Flower's processes ``python -m crossdc.clients.supernode`` is
AS_OPTION = "--as"
#: this module's name (``__name__`` is ``__main__`` when it runs as ``python -m``)
MODULE = "crossdc.clients.supernode"
#: what the SuperExec's fork server imports once for every ClientApp it starts
CLIENTAPP_PRELOAD = "crossdc.clients.clientapp_preload"
#: the pid of the SuperExec that starts the fork server, in the fork server's environment (it dies with it)
FORKSERVER_PARENT_ENV = "CROSSDC_FORKSERVER_PARENT"


def command(process: str = "flower-supernode") -> list[str]:
    """The start of the command line of one of Flower's processes as crossdc starts it (its arguments follow, as for
    Flower's own): ``flower-supernode`` (the default), :data:`SUPEREXEC` or :data:`CLIENTAPP`."""
    if process == "flower-supernode":
        return [sys.executable, "-m", MODULE]
    if process not in (SUPEREXEC, CLIENTAPP):
        raise ValueError(f"crossdc starts flower-supernode, {SUPEREXEC} or {CLIENTAPP}, not {process!r}")
    return [sys.executable, "-m", MODULE, AS_OPTION, process]


#: what starts one of Flower's processes in crossdc's place: called with the arguments Flower gave it
Launcher = Callable[[list[str]], Any]


def start_process(process: str) -> Launcher:
    """A launcher that starts crossdc's :func:`command` for `process` as a new process (same arguments)."""
    return lambda args: subprocess.Popen([*command(process), *args])


class ForkServerLaunch:
    """Starts each ClientApp as a child of a fork server that imported what a ClientApp needs once (the
    ``forkserver`` start method of :mod:`multiprocessing`, preloading :data:`CLIENTAPP_PRELOAD`): Flower's own
    ``flwr_clientapp`` runs in a new process per message, as under Flower's SuperExec, without paying its imports
    (1.7 s of CPU on the 2-core development machine, several seconds of wall time when four ClientApps start at once
    beside the trainers). The server starts with the launcher, before the first message, and dies with this process
    (SIGKILL from the kernel: :data:`FORKSERVER_PARENT_ENV` tells it which parent to die with)."""

    def __init__(self) -> None:
        import multiprocessing
        import multiprocessing.forkserver

        os.environ[FORKSERVER_PARENT_ENV] = str(os.getpid())
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload([CLIENTAPP_PRELOAD])
        multiprocessing.forkserver.ensure_running()

    def __call__(self, args: list[str]) -> Any:
        process = self.context.Process(target=clientapp_main, args=(list(args),), name=CLIENTAPP)
        process.start()
        return process


class _RenamedLaunches(types.ModuleType):
    """Stands in for the ``subprocess`` module inside a flwr module: the same module, except that ``Popen`` of one of
    Flower's commands calls crossdc's launcher for it instead (with the same arguments)."""

    def __init__(self, launchers: dict[str, Launcher]) -> None:
        super().__init__("subprocess")
        self._launchers = launchers

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, args: Any, *rest: Any, **options: Any) -> Any:  # noqa: N802 (subprocess's name)
        if isinstance(args, list | tuple) and args and args[0] in self._launchers:
            return self._launchers[args[0]](list(args[1:]))
        return subprocess.Popen(args, *rest, **options)


def patch_launch(module: types.ModuleType, flower_command: str, launched_as: str, launch: Launcher | None = None) -> None:
    """Make `module` (a flwr module that starts `flower_command` with ``subprocess.Popen`` and does not use what it
    returns) call `launch` for it instead (default: :func:`start_process`, crossdc's :func:`command` for it).
    FlowerLoopChanged when the module does not start it that way: it does not use the ``subprocess`` module by that
    name, or neither its source nor ``TASK_TYPE_TO_COMMAND`` names the command as `launched_as` says (``source`` or
    ``task-type``)."""
    source = inspect.getsource(module)
    if launched_as == "source":
        names_it = f'"{flower_command}"' in source
    else:
        from flwr.supercore.constant import TASK_TYPE_TO_COMMAND, TaskType

        names_it = TASK_TYPE_TO_COMMAND.get(TaskType.CLIENT_APP) == flower_command and "TASK_TYPE_TO_COMMAND" in source
    current = getattr(module, "subprocess", None)
    calls = re.findall(r"(\w+\s*=\s*)?subprocess\.Popen\(", source)
    if (not names_it or not calls or any(assigned for assigned in calls)
            or not (current is subprocess or isinstance(current, _RenamedLaunches))):
        raise FlowerLoopChanged(f"{module.__name__} no longer starts {flower_command} with subprocess.Popen (or now "
                                "keeps what it returns): flwr's process launch changed; review crossdc.clients.supernode "
                                "before using this flwr version")
    module.subprocess = _RenamedLaunches({flower_command: launch or start_process(flower_command)})  # type: ignore[attr-defined]


def cli_package_imports(source: str) -> dict[str, tuple[str, ...]]:
    """What a package ``__init__``'s source imports from its own submodules (``from .m import a, b``), by submodule;
    any other import or statement with an effect is listed under ``"?"``."""
    found: dict[str, tuple[str, ...]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found[node.module] = tuple(alias.name for alias in node.names)
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            continue
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):  # a docstring is harmless
            found.setdefault("?", ())
            found["?"] += (ast.dump(node)[:60],)
    return found


def load_clientapp() -> Callable[[], Any]:
    """Flower's ``flwr_clientapp`` function, imported without the SuperNode's command line (see the module
    docstring). FlowerLoopChanged when ``flwr.supernode.cli``'s ``__init__`` does more than import its two entry
    points."""
    spec = importlib.util.find_spec(CLI_PACKAGE)  # imports flwr.supernode, not the package itself
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        raise FlowerLoopChanged(f"{CLI_PACKAGE} is not a package here: review crossdc.clients.supernode")
    found = cli_package_imports(Path(spec.origin).read_text())
    if found != KNOWN_CLI_IMPORTS:
        raise FlowerLoopChanged(f"{CLI_PACKAGE}'s __init__ imports {found}, crossdc knows {KNOWN_CLI_IMPORTS}: review "
                                "crossdc.clients.supernode before using this flwr version")
    if CLI_PACKAGE not in sys.modules:  # the package without its __init__: its submodules import as usual
        package = importlib.util.module_from_spec(spec)
        sys.modules[CLI_PACKAGE] = package
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    return flwr_clientapp


def clientapp_main(argv: Sequence[str]) -> int:
    """Flower's ``flwr-clientapp`` with arguments `argv` (see :func:`load_clientapp`), in a process that dies with
    the run's root (a child of the fork server has no watch of its own until it starts one here)."""
    from crossdc.experiment.processes import die_with_run_root

    die_with_run_root()
    flwr_clientapp = load_clientapp()
    sys.argv = [CLIENTAPP, *argv]
    result = flwr_clientapp()
    return 0 if result is None else int(result)


def main() -> None:
    """``flower-supernode`` with the shorter waits (and its SuperExec started as crossdc's); with ``--as
    flower-superexec`` or ``--as flwr-clientapp`` first, that process of Flower's instead. Each dies at once with the
    run's root (crossdc.experiment.processes.die_with_run_root), where Flower's own watch of a parent stops it
    gracefully, seconds after that parent is gone, if its graceful exit ends at all."""
    from crossdc.experiment.processes import die_with_run_root

    die_with_run_root()
    args = sys.argv[1:]
    if args[:1] == [AS_OPTION]:
        process, rest = (args[1] if len(args) > 1 else ""), args[2:]
        if process == SUPEREXEC:
            patch_launch(importlib.import_module(CLIENTAPP_LAUNCH_MODULE), CLIENTAPP, "task-type", ForkServerLaunch())
            from flwr.supercore.cli import flower_superexec

            sys.argv = [SUPEREXEC, *rest]
            sys.exit(flower_superexec())
        if process == CLIENTAPP:
            sys.exit(clientapp_main(rest))
        sys.exit(f"{AS_OPTION} takes {SUPEREXEC} or {CLIENTAPP}, not {process!r}")
    patch_supernode_loop()
    patch_launch(importlib.import_module(LOOP_MODULE), SUPEREXEC, "source")
    shorten_reconnect_wait()
    if os.environ.get(PULSE_ENV):
        record_pulse(Path(os.environ[PULSE_ENV]))
    from flwr.supernode.cli import flower_supernode

    sys.argv[0] = "flower-supernode"
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()

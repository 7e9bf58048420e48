"""`crossdc node start`: a datacenter's two long-lived processes in a standing federation.

`run_node` promises: the node service (crossdc.clients.node) and a Flower SuperNode whose node config names
the datacenter and the service (so the ClientApp of every message reaches the run's persistent trainer) run
until Ctrl-C/SIGTERM or until one of them exits; then both are stopped (the trainers with the service), and an
unexpected exit is an error naming the process and its log. The SuperNode keeps its pulse file
(:func:`supernode_pulse`, fresh while the SuperLink accepts it) for :func:`node_health`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from crossdc.clients import supernode
from crossdc.clients.node import node_authkey, node_socket
from crossdc.experiment.processes import ProcessGroup, flower_env, free_port, run_root_env
from crossdc.protocol import DATACENTER, NODE_AUTHKEY_FILE, NODE_SERVICE


class NodeFailed(RuntimeError):
    """One of the node's processes exited on its own."""


def node_env(state_dir: Path) -> dict[str, str]:
    """Environment of the node's processes: Flower's, with the node's own FLWR_HOME, and the SuperNode's pulse file;
    this process is their root (every crossdc process of the node, the run trainers included, dies with it)."""
    return {**flower_env(state_dir / "flwr-home"), supernode.PULSE_ENV: str(supernode_pulse(state_dir)), **run_root_env()}


def supernode_pulse(state_dir: Path) -> Path:
    """The file the node's SuperNode touches whenever the SuperLink accepts it (crossdc.clients.supernode.record_pulse)."""
    return state_dir / "supernode.pulse"


#: the SuperNode of a healthy node was accepted by the SuperLink this recently (an idle one pulls every fraction of a
#: second; Flower's node heartbeat goes at least every 30 s while it waits for a ClientApp's reply)
PULSE_MAX_AGE_S = 60.0


def node_health(state_dir: Path, max_age_s: float = PULSE_MAX_AGE_S) -> str:
    """What a healthy node shows, in one line: its node service answers an authenticated ping on its socket, and the
    SuperLink accepted its SuperNode within `max_age_s`. NodeFailed saying what is wrong otherwise."""
    from crossdc.clients.channel import TrainerFailed, TrainerUnavailable, call_trainer

    authkey = state_dir / "authkey"
    if not authkey.is_file():
        raise NodeFailed(f"no node in {state_dir} (no authkey: `crossdc node start` has not run there)")
    try:
        answer = call_trainer(node_socket(state_dir), authkey.read_bytes(), {"op": "ping"}, connect_timeout_s=2.0)
    except (TrainerUnavailable, TrainerFailed) as err:
        raise NodeFailed(f"the node service does not answer: {err}") from None
    pulse = supernode_pulse(state_dir)
    try:
        age = time.time() - pulse.stat().st_mtime
    except FileNotFoundError:
        raise NodeFailed(f"the SuperLink has not accepted the SuperNode yet (see {state_dir / 'logs' / 'supernode.log'})") from None
    if age > max_age_s:
        raise NodeFailed(f"the SuperLink last accepted the SuperNode {age:.0f} s ago (see {state_dir / 'logs' / 'supernode.log'})")
    return f"node {answer.get('datacenter')}: node service answers; the SuperLink accepted the SuperNode {age:.0f} s ago"


#: what flwr 1.42's SuperNode logs when the SuperLink refuses its key (its process then exits with code 1)
REFUSED_MARKERS = ("Failed to activate SuperNode", "Exit Code: 305")


def supernode_command(superlink: str, datacenter: str, state_dir: Path, root_certificates: Path | None, insecure: bool,
                      auth_key: Path | None = None) -> list[str]:
    """The SuperNode's command line (TLS unless `insecure`; signed with the enrolled key `auth_key` if given)."""
    node_config = (f'{DATACENTER}="{datacenter}" {NODE_SERVICE}="{node_socket(state_dir)}" '
                   f'{NODE_AUTHKEY_FILE}="{state_dir / "authkey"}"')
    security = ["--insecure"] if insecure else ["--root-certificates", str(root_certificates)]
    auth = ["--auth-supernode-private-key", str(auth_key)] if auth_key is not None else []
    return [*supernode.command(), *security, *auth, "--superlink", superlink, "--port", str(free_port()),
            "--node-config", node_config]


def exit_explanation(name: str, code: int | None, log_path: Path, auth_key: Path | None) -> str:
    """Why one of the node's processes ended, in words an admin can act on (read from the end of its log)."""
    try:
        with open(log_path, "rb") as log:
            log.seek(max(0, log_path.stat().st_size - 20_000))
            tail = log.read().decode(errors="replace")
    except OSError:
        tail = ""
    if name == "supernode" and auth_key is not None and any(marker in tail for marker in REFUSED_MARKERS):
        return (f"the SuperLink refused this datacenter's key {auth_key} (not enrolled, suspended or revoked; "
                f"see `crossdc enroll`); supernode exited (code {code})")
    if name == "supernode" and auth_key is not None and code == 0:
        return ("the SuperNode stopped on its own: the SuperLink no longer accepts this datacenter's key (suspended or "
                "revoked? or the SuperLink lost its state: started again, the node comes back once the operator's API "
                "service has registered the key again, within seconds)")
    return f"{name} exited (code {code})"


def superlink_host(superlink: str) -> str:
    """The host of a SuperLink address HOST:PORT (an IPv6 host without its brackets): where the coordinator's
    heartbeat is reached."""
    host = superlink.rpartition(":")[0] or superlink
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def run_node(superlink: str, datacenter: str, state_dir: Path, root_certificates: Path | None, insecure: bool,
             max_runs: int = 2, ready_timeout_s: float = 60.0, auth_key: Path | None = None) -> None:
    """Start the node service and the SuperNode; return on Ctrl-C, raise NodeFailed if either exits (a SuperNode
    whose key the SuperLink refuses or stops accepting, after a revocation, exits)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    node_authkey(state_dir)
    env = node_env(state_dir)
    processes = ProcessGroup()
    logs = state_dir / "logs"
    try:
        service = processes.start("node-service", [sys.executable, "-m", "crossdc.clients.node", "--state-dir", str(state_dir),
                                                   "--datacenter", datacenter, "--max-runs", str(max_runs),
                                                   "--coordinator-host", superlink_host(superlink)],
                                  logs / "node-service.log", env=env)
        deadline = time.monotonic() + ready_timeout_s
        while not node_socket(state_dir).exists():
            if service.process.poll() is not None or time.monotonic() > deadline:
                raise NodeFailed(f"the node service did not start; see {service.log_path}")
            time.sleep(0.1)
        supernode_pulse(state_dir).unlink(missing_ok=True)  # a former SuperNode's
        processes.start("supernode", supernode_command(superlink, datacenter, state_dir, root_certificates, insecure, auth_key),
                        logs / "supernode.log", env=env)
        while True:
            for managed in processes.processes:
                if managed.process.poll() is not None:
                    why = exit_explanation(managed.name, managed.process.returncode, managed.log_path, auth_key)
                    raise NodeFailed(f"{why}; see {managed.log_path}")
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        processes.stop_all()

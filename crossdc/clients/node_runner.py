"""`crossdc node start`: a datacenter's two long-lived processes in a standing federation.

`run_node` promises: the node service (crossdc.clients.node) and a Flower SuperNode whose node config names
the datacenter and the service (so the ClientApp of every message reaches the run's persistent trainer) run
until Ctrl-C/SIGTERM or until one of them exits; then both are stopped (the trainers with the service), and an
unexpected exit is an error naming the process and its log.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from crossdc.clients.client_app import NODE_AUTHKEY_FILE, NODE_SERVICE
from crossdc.clients.node import node_authkey, node_socket
from crossdc.platform.processes import ProcessGroup, flower_env, free_port, venv_bin


class NodeFailed(RuntimeError):
    """One of the node's processes exited on its own."""


def node_env(state_dir: Path) -> dict[str, str]:
    """Environment of the node's processes: Flower's, with the node's own FLWR_HOME."""
    return flower_env(state_dir / "flwr-home")


def supernode_command(superlink: str, datacenter: str, state_dir: Path, root_certificates: Path | None, insecure: bool) -> list[str]:
    """The SuperNode's command line (TLS unless `insecure`)."""
    node_config = (f'datacenter="{datacenter}" {NODE_SERVICE}="{node_socket(state_dir)}" '
                   f'{NODE_AUTHKEY_FILE}="{state_dir / "authkey"}"')
    security = ["--insecure"] if insecure else ["--root-certificates", str(root_certificates)]
    return [venv_bin("flower-supernode"), *security, "--superlink", superlink, "--port", str(free_port()), "--node-config", node_config]


def run_node(superlink: str, datacenter: str, state_dir: Path, root_certificates: Path | None, insecure: bool,
             max_runs: int = 2, ready_timeout_s: float = 60.0) -> None:
    """Start the node service and the SuperNode; return on Ctrl-C, raise NodeFailed if either exits."""
    state_dir.mkdir(parents=True, exist_ok=True)
    node_authkey(state_dir)
    env = node_env(state_dir)
    processes = ProcessGroup()
    logs = state_dir / "logs"
    try:
        service = processes.start("node-service", [sys.executable, "-m", "crossdc.clients.node", "--state-dir", str(state_dir),
                                                   "--datacenter", datacenter, "--max-runs", str(max_runs)],
                                  logs / "node-service.log", env=env)
        deadline = time.monotonic() + ready_timeout_s
        while not node_socket(state_dir).exists():
            if service.process.poll() is not None or time.monotonic() > deadline:
                raise NodeFailed(f"the node service did not start; see {service.log_path}")
            time.sleep(0.1)
        processes.start("supernode", supernode_command(superlink, datacenter, state_dir, root_certificates, insecure),
                        logs / "supernode.log", env=env)
        while True:
            for managed in processes.processes:
                if managed.process.poll() is not None:
                    raise NodeFailed(f"{managed.name} exited (code {managed.process.returncode}); see {managed.log_path}")
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        processes.stop_all()

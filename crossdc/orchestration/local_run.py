"""Runs one experiment on this machine: trainers, a SuperLink, one SuperNode per datacenter.

The WAN: each datacenter (its trainer, worker ranks, SuperNode and ClientApps)
runs in its own network namespace and every packet it exchanges with the
coordinator (SuperLink, ServerApp, database, in the root namespace) or another
datacenter crosses the emulated links (crossdc.wan.network). Where namespaces
cannot be made, the run says why and falls back to the link relay, which
emulates Flower's own traffic only (and cannot emulate datacenter-to-datacenter
links).

Promises: every process it starts (trainers, SuperLink, SuperNodes and what
Flower spawns under them) is stopped when the run ends — on success, on error
and on Ctrl-C — and the run's row in SQL ends as finished, failed or
interrupted, never "running". If this process itself is killed (SIGKILL, the
OOM killer), every one of them dies within seconds without recording anything
(crossdc.experiment.processes.die_with_run_root): the row stays "running"
until `crossdc resume` continues the run. A gossip run's coordinator is off
the training path: if its ServerApp dies without recording the run's end
(killed), the run submits the app again (attempt 2 and on; at most
MAX_COORDINATOR_RESTARTS times), which catches up on what the datacenters trained meanwhile
(crossdc.federation.gossip_loop). The same ServerApp/ClientApp code runs under
Flower's Deployment Engine (``engine="deployment"``) and its simulation
(``engine="simulation"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.exc import OperationalError

from crossdc import protocol
from crossdc.clients import supernode
from crossdc.clients.channel import TrainerUnavailable, call_trainer
from crossdc.db.engine import absolute_database_url, make_engine, upgrade
from crossdc.db.errors import DatabaseUnavailable
from crossdc.db.queries import get_run, get_run_at, list_rounds
from crossdc.db.runlog import RESUME_REQUESTED, RunLog
from crossdc.db.security import record_audit_now
from crossdc.deployment.superlink_control import ControlError, SuperLinkControl
from crossdc.experiment.config import ExperimentConfig
from crossdc.experiment.processes import (
    ManagedProcess,
    ProcessGroup,
    die_with_parent,
    ensure_port_free,
    flower_env,
    free_port,
    is_running,
    kill_processes_with_env,
    parse_process_identity,
    process_identity,
    processes_with_env,
    run_root_env,
    same_process_alive,
    venv_bin,
    wait_for_port,
)
from crossdc.experiment.rundir import (
    SETTINGS_FAULT_INJECTION,
    SETTINGS_GOSSIP_ADDRESSES,
    SETTINGS_HEARTBEAT,
    SETTINGS_LINK_EMULATOR,
    SETTINGS_PIPELINE_GROUP,
    SETTINGS_SUPERLINK,
    SETTINGS_SUPERLINK_CA,
    RunDir,
)
from crossdc.federation.server_checkpoint import SETTINGS_ATTEMPT, SETTINGS_RESUME, SETTINGS_URL
from crossdc.strategies.pipeline import replica_groups
from crossdc.strategies.registry import strategy_class
from crossdc.wan.link_relay import LinkRelay
from crossdc.wan.network import EmulatedNetwork, namespaces_unavailable

log = logging.getLogger("crossdc.local_run")

HOST = "127.0.0.1"
TRAINER_START_TIMEOUT_S = 300.0
#: the port of every datacenter's gossip rendezvous store in its namespace (each namespace has its own address)
GOSSIP_PORT = 29700
#: the port of a pipeline run's rendezvous, in the first stage's namespace
PIPELINE_PORT = 29800
#: how often Flower's own run status is checked, and how long SQL may lag behind Flower's "finished"
FLOWER_CHECK_S = 10.0
FLOWER_END_GRACE_S = 5.0
#: how often a local run looks for its ServerApp process
SERVERAPP_CHECK_S = 2.0
#: how many times a gossip run submits its ServerApp again after it died
MAX_COORDINATOR_RESTARTS = 3
FLOWER_APP_TEMPLATE = Path(__file__).with_name("flower_app") / "pyproject.toml"
#: Ray runs its workers (Flower's ClientApp actors) at nice 15 by default; beside the datacenters' trainers and anything
# else busy on the host they then get a few percent of a core, and a ClientApp that answers in milliseconds on an idle
# machine took minutes to answer its first message (the run's discovery timed out). The actors only relay to the
# trainers, so they run at the trainers' priority.
RAY_SYSTEM_CONFIG: dict[str, Any] = {"worker_niceness": 0}

ProgressCallback = Callable[[list[dict[str, Any]]], None]


class RunFailed(RuntimeError):
    """The run ended as failed; the message says why (the run log has details)."""


@dataclass
class LocalRunOptions:
    db_url: str
    engine: str = "deployment"  # or "simulation"
    superlink_port: int = 8000
    runs_root: Path = Path("runs")
    progress: ProgressCallback | None = None
    run_id: str | None = None
    #: how long the ServerApp may buffer run-log writes while the database does not answer
    db_max_outage_s: float = 300.0
    #: HOST:PORT of a standing federation's SuperLink (its private Control API address): submit the run there
    #: instead of starting trainers, SuperNodes and a SuperLink; Ctrl-C detaches, the run goes on
    superlink: str | None = None
    #: with `superlink`: return right after submitting (follow later with `crossdc runs follow RUN_ID`)
    detach: bool = False
    #: with `superlink`: the CA of a SuperLink that serves TLS (one with SuperNode authentication must); None: plain HTTP
    superlink_ca: Path | None = None
    #: continue the run `run_id` (its folder under `runs_root` holds its settings and the datacenters' state
    #: stores) from its newest checkpoint, as the next attempt at it
    resume: bool = False
    #: let the run's trainers spoil an update on request (chaos tests only: crossdc.clients.fault_injection)
    fault_injection: bool = False
    #: with `superlink`: who submits, for the audit log (`crossdc run` and `crossdc resume`: "cli:<user>"); None: not
    #: audited here (the API audits the runs it submits itself)
    audited_as: str | None = None


class Detached(Exception):
    """The command stopped following a run on a standing federation; the run goes on."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"detached from run {run_id}; it goes on: crossdc runs follow {run_id}")
        self.run_id = run_id


@dataclass
class LocalRunResult:
    run_id: str
    summary: dict[str, Any]
    run_dir: Path
    worker_pids: dict[str, list[int]] = field(default_factory=dict)  # each datacenter's worker group, rank 0 first
    child_pids: list[int] = field(default_factory=list)


RUN_MARKER_ENV = "CROSSDC_RUN_DIR"
#: how a local run emulates its WAN (recorded in the run's settings as SETTINGS_LINK_EMULATOR)
EMULATOR_NAMESPACES = "delay-line"
EMULATOR_RELAY = "relay"


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def run_env(run_dir: RunDir) -> dict[str, str]:
    """Environment for the run's processes: Flower's (processes.flower_env) with the run's FLWR_HOME, one thread per
    process, a marker (CROSSDC_RUN_DIR) that every process Flower spawns inherits, so clean-up can find them all, and
    this process as the run's root (processes.RUN_ROOT_ENV: every crossdc process of the run dies with it)."""
    env = flower_env(run_dir.flwr_home)
    env[RUN_MARKER_ENV] = str(run_dir.path)
    env.update(run_root_env())
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def write_flower_app(run_dir: RunDir, superlink_address: str, root_certificates: Path | None = None,
                     template: Path = FLOWER_APP_TEMPLATE) -> None:
    """The Flower app folder (`template` as its pyproject.toml: crossdc's app by default) and the federation
    (`crossdc` → `superlink_address`, TLS verified against `root_certificates` if given) that `flwr run` submits to."""
    run_dir.flwr_home.mkdir(parents=True, exist_ok=True)
    security = f'root-certificates = "{root_certificates.resolve()}"' if root_certificates is not None else "insecure = true"
    (run_dir.flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "crossdc"\n\n[superlink.crossdc]\naddress = "{superlink_address}"\n{security}\n'
    )
    run_dir.app_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, run_dir.app_dir / "pyproject.toml")


def start_superlink(processes: ProcessGroup, run_dir: RunDir, host: str, port: int) -> ManagedProcess:
    """Start Flower's SuperLink (plain HTTP) on `host`:`port` and the SuperExec that launches its ServerApps as two of
    `processes`, logging to the run's superlink.log; RunFailed if it does not listen, or if something else already did.

    The SuperExec is Flower's own, with the arguments the SuperLink would give it, but started here (the SuperLink's
    ``--isolation process``) rather than by the SuperLink: a child of this process, it dies with it (SIGKILL from the
    kernel). Started by the SuperLink, it outlived a killed run by tens of seconds or more: its only watch is Flower's
    poll of its parent, whose graceful exit then waited on a connection to the dead SuperLink's emulated address."""
    ensure_port_free(HOST, port)
    ensure_port_free(host, port)
    superlink = processes.start(
        "superlink",
        [venv_bin("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation", "--isolation", "process",
         "--host", host, "--port", str(port)],
        run_dir.logs / "superlink.log", env=run_env(run_dir),
    )
    try:
        wait_for_port(host, port, 60, alive=superlink)
    except (RuntimeError, TimeoutError) as err:
        raise RunFailed(f"the SuperLink did not start: {err}") from None
    time.sleep(0.5)
    if superlink.process.poll() is not None:  # something else answered on the port: never join another run's SuperLink
        raise RunFailed(f"the SuperLink exited at start-up (code {superlink.process.returncode}); see {superlink.log_path}")
    processes.start("superexec", [venv_bin("flower-superexec"), "--insecure", "--runtime-api-address", f"{host}:{port}",
                                  "--parent-pid", str(superlink.process.pid)],
                    run_dir.logs / "superlink.log", env=run_env(run_dir))
    return superlink


def submit_flower_app(run_dir: RunDir, run_config: dict[str, str | int]) -> int:
    """`flwr run` the run's app folder (:func:`write_flower_app`) on its federation with `run_config` overriding the
    app's config; Flower's run id. RunFailed, with Flower's last words, if it refuses the run."""
    overrides = run_dir.path / "flower-run-config.toml"
    overrides.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in run_config.items()))
    completed = subprocess.run(
        [venv_bin("flwr"), "run", str(run_dir.app_dir), "crossdc", "--run-config", str(overrides), "--format", "json"],
        env=run_env(run_dir), capture_output=True, text=True, timeout=120, preexec_fn=die_with_parent,
    )
    try:
        answer = json.loads(completed.stdout)
    except json.JSONDecodeError:
        answer = {}
    if completed.returncode != 0 or not answer.get("success", False) or "run-id" not in answer:
        detail = (answer.get("error-message") or completed.stderr or completed.stdout).strip().splitlines()
        raise RunFailed(f"Flower refused the run: {detail[-1] if detail else 'no output'}")
    return int(answer["run-id"])


class LocalRun:
    """One run of one experiment on this machine (see the module docstring)."""

    def __init__(self, config: ExperimentConfig, options: LocalRunOptions) -> None:
        self.config = config
        self.options = dataclasses.replace(options, db_url=absolute_database_url(options.db_url))
        self.run_id = options.run_id or uuid.uuid4().hex
        self.run_dir = RunDir(Path(options.runs_root).resolve() / self.run_id)
        self.processes = ProcessGroup()
        self.worker_pids: dict[str, list[int]] = {}
        self.relays: dict[str, LinkRelay] = {}
        self.network: EmulatedNetwork | None = None
        self.emulator: str | None = None  # EMULATOR_NAMESPACES or EMULATOR_RELAY for a local deployment run
        self.faults_done: set[int] = set()
        self.started_at = time.time()
        #: a killed ServerApp (kill_coordinator) is not submitted again before this time (monotonic)
        self.coordinator_away_until = 0.0
        self.coordinator_restarts = 0

    # --------------------------------------------------------------- set-up
    def prepare(self) -> None:
        if self.options.resume and self.options.superlink is None:
            self._stop_earlier_attempts()
        if self.options.engine == "simulation" and (self.config.link_faults or self.config.links
                                                     or any(dc.link for dc in self.config.datacenters)):
            raise RunFailed("WAN links and link faults are emulated between SuperNodes and the SuperLink: "
                            "use the deployment engine (remove the links to simulate)")
        if self.options.engine == "deployment" and self.options.superlink is None:
            ensure_port_free(HOST, self.options.superlink_port)  # fail before anything starts; checked again at launch
            self.emulator = self._choose_emulator()
        upgrade(self.options.db_url)
        settings = {"run_id": self.run_id, "db_url": self.options.db_url, "config": self.config.raw,
                    "db_max_outage_s": self.options.db_max_outage_s, SETTINGS_ATTEMPT: 1}
        if self.emulator is not None:
            settings[SETTINGS_LINK_EMULATOR] = self.emulator
        if self.options.superlink is not None:
            settings[SETTINGS_SUPERLINK] = self.options.superlink
            settings[SETTINGS_SUPERLINK_CA] = str(self.options.superlink_ca) if self.options.superlink_ca else None
        if self.options.fault_injection:
            settings[SETTINGS_FAULT_INJECTION] = True
        if self.config.checkpoint.every_rounds > 0:
            settings[SETTINGS_URL] = checkpoint_url(self.config.checkpoint.dir, self.run_id)
        if self.options.resume:
            before = self.run_dir.settings()
            settings.update({SETTINGS_ATTEMPT: int(before.get(SETTINGS_ATTEMPT, 1)) + 1, SETTINGS_RESUME: True})
            if before.get(SETTINGS_URL):
                settings[SETTINGS_URL] = before[SETTINGS_URL]
        self.run_dir.create(settings)
        if self.options.superlink is None:  # on a standing federation the coordinator is the SuperLink's ServerApp
            (self.run_dir.path / COORDINATOR_PID_FILE).write_text(process_identity(os.getpid()) or str(os.getpid()))
        with RunLog(self.options.db_url) as runlog:
            if self.options.resume:
                # the new attempt is named before the run is running again: an older attempt's end is ignored from then on
                runlog.log_event(run_id=self.run_id, kind=RESUME_REQUESTED, detail={"attempt": settings[SETTINGS_ATTEMPT]})
                runlog.resume_run(run_id=self.run_id)
            else:
                runlog.start_run(run_id=self.run_id, name=self.config.run.name, strategy=self.config.strategy.name,
                                 config=self.config.raw, rounds_planned=self.config.run.rounds)
            runlog.flush(timeout=30)

    def _stop_earlier_attempts(self) -> None:
        """Before a local resume: SIGKILL whatever of the run's earlier attempts still runs here (found by the run's
        marker; SIGKILL, so that none records an end of its own). Every process of a run dies with its root
        (processes.die_with_run_root), so this is normally nothing; one that lived on (started by an older crossdc)
        would share the datacenters' trainer sockets with the new attempt, and an orphaned ServerApp would record its
        own end ("interrupted: SystemExit: 0") over the resumed attempt's."""
        pids = kill_processes_with_env(RUN_MARKER_ENV, str(self.run_dir.path), grace_s=10.0, first=signal.SIGKILL)
        if pids:
            log.warning("stopped %d process(es) an earlier attempt at run %s left running: %s", len(pids), self.run_id,
                        ", ".join(map(str, sorted(pids))))

    def _choose_emulator(self) -> str:
        """"delay-line" (datacenters in network namespaces) where this machine allows it, else "relay" (said once)."""
        reason = namespaces_unavailable()
        if reason is None:
            return EMULATOR_NAMESPACES
        needs_mesh = self.config.links or any(f.between is not None for f in self.config.link_faults)
        if needs_mesh:
            raise RunFailed(f"datacenter-to-datacenter links need the namespace emulator, which cannot run here: {reason}")
        log.warning("WAN emulated by the link relay (Flower's traffic only): %s", reason)
        return EMULATOR_RELAY

    def start_network(self) -> None:
        """Put every datacenter in its own namespace behind its emulated links (the delay line measures them); for a
        gossip run, tell every datacenter where each one's gossip rendezvous is (its emulated address); for a pipeline
        run, where the stages' group meets (the first stage's address) and which interface reaches the others."""
        if self.emulator == EMULATOR_NAMESPACES:
            star = [(dc.name, dc.link) for dc in self.config.datacenters]
            mesh = [(*link.between, link.link) for link in self.config.links]
            self.network = EmulatedNetwork(star, mesh, self.run_dir.logs / "links", seed=self.config.run.seed,
                                           log_path=self.run_dir.logs / "delay-line.log").start()
        if self.config.run.heartbeat_timeout_s > 0:  # the coordinator's heartbeat socket, where every datacenter reaches it
            self.run_dir.update_settings({SETTINGS_HEARTBEAT: [self.coordinator_host, free_port()]})
        if strategy_class(self.config.strategy.name).loop == "gossip":
            network = self.network
            addresses = {dc: [network.address(dc), GOSSIP_PORT] if network is not None else [HOST, free_port()]
                         for dc in self.config.datacenter_names}
            self.run_dir.update_settings({SETTINGS_GOSSIP_ADDRESSES: addresses})
        if strategy_class(self.config.strategy.name).loop == "pipeline":
            # each replica's group meets at its first stage
            firsts = [names[0] for names in replica_groups(self.config.datacenter_names,
                                                            int(self.config.strategy.params.get("replicas", 1)))]
            network = self.network
            masters = ([[network.address(first), PIPELINE_PORT] for first in firsts] if network is not None
                       else [[HOST, free_port()] for _ in firsts])
            interfaces = {dc: network.device(dc) for dc in self.config.datacenter_names} if network is not None else {}
            self.run_dir.update_settings({SETTINGS_PIPELINE_GROUP: {"master": masters[0], "masters": masters,
                                                                    "interfaces": interfaces}})

    def _datacenter_process(self, name: str) -> dict[str, Any]:
        """How a datacenter's process starts: its environment, and (with the namespace emulator) its namespace, whose
        loopback carries the traffic between the datacenter's own processes (gloo is told so)."""
        env = run_env(self.run_dir)
        if self.network is None:
            return {"env": env}
        env["GLOO_SOCKET_IFNAME"] = "lo"
        return {"env": env, "preexec": self.network.preexec(name)}

    @property
    def coordinator_host(self) -> str:
        """The address the SuperLink listens on: the coordinator's emulated address, or loopback (relay, no emulator)."""
        return self.network.coordinator_address if self.network is not None else HOST

    def start_trainers(self) -> None:
        for name in self.config.datacenter_names:
            self._start_trainer(name)
        for name in self.config.datacenter_names:
            self._await_trainer(name)

    def _start_trainer(self, name: str) -> None:
        self.processes.start(
            f"trainer-{name}",
            [sys.executable, "-m", "crossdc.clients.trainer", "--run-dir", str(self.run_dir.path), "--datacenter", name],
            self.run_dir.logs / f"trainer-{name}.log", **self._datacenter_process(name),
        )

    def _await_trainer(self, name: str) -> None:
        """Wait until the trainer of `name` answers a ping; RunFailed if it exits or takes too long."""
        managed = self.processes.find(f"trainer-{name}")
        assert managed is not None
        authkey = self.run_dir.authkey()
        deadline = time.monotonic() + TRAINER_START_TIMEOUT_S
        while True:
            if managed.process.poll() is not None:
                raise RunFailed(f"trainer of '{name}' exited at start-up (code {managed.process.returncode}); see {managed.log_path}")
            try:
                answer = call_trainer(self.run_dir.trainer_socket(name), authkey, {"op": "ping"}, connect_timeout_s=1.0)
                self.worker_pids[name] = [int(pid) for pid in answer["worker_pids"]]
                return
            except TrainerUnavailable:
                if time.monotonic() > deadline:
                    raise RunFailed(f"trainer of '{name}' did not start within {TRAINER_START_TIMEOUT_S:.0f}s") from None

    def _start_supernode(self, name: str) -> None:
        if self.network is not None:  # its packets cross the datacenter's emulated link
            superlink = f"{self.network.coordinator_address}:{self.options.superlink_port}"
        else:
            superlink = f"{HOST}:{self.relays[name].port}"
        node_config = f'{protocol.DATACENTER}="{name}" {protocol.NODE_TRAINER}="{self.run_dir.trainer_socket(name)}"'
        self.processes.start(
            f"supernode-{name}",
            [*supernode.command(), "--insecure", "--superlink", superlink, "--port", str(free_port()),
             "--node-config", node_config],
            self.run_dir.logs / f"supernode-{name}.log", **self._datacenter_process(name),
        )

    def kill_datacenter(self, name: str, trainer: bool = True) -> list[int]:
        """SIGKILL the datacenter's SuperNode (with the ClientApp it may be running) and, with `trainer`, its trainer
        (with its worker group): a crash of that datacenter's machines. Its state store stays on disk. Returns the
        pids killed. The run goes on without it until :meth:`restart_datacenter`."""
        killed = [self.processes.kill(f"supernode-{name}")]
        if trainer:
            killed.append(self.processes.kill(f"trainer-{name}"))
            self.run_dir.trainer_socket(name).unlink(missing_ok=True)
        return killed

    def restart_datacenter(self, name: str) -> None:
        """Start what :meth:`kill_datacenter` killed: the trainer (it restores its state from the state store) and a
        new SuperNode through the same link; the ServerApp finds the new node and the datacenter rejoins."""
        if self.processes.find(f"trainer-{name}") is None:
            self._start_trainer(name)
            self._await_trainer(name)
        if self.processes.find(f"supernode-{name}") is None:
            self._start_supernode(name)

    @property
    def gossip(self) -> bool:
        """Whether the run's strategy is decentralized gossip (its coordinator only observes)."""
        return strategy_class(self.config.strategy.name).loop == "gossip"

    def kill_coordinator(self, away_s: float = 0.0) -> list[int]:
        """SIGKILL the run's ServerApp (what a crash of the coordinator's machine does to it; the SuperLink and the
        datacenters live on) and keep it away for `away_s` seconds: a gossip run then submits it again and it
        catches up; any other run fails. Returns the pids killed."""
        pids = self._serverapp_pids()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.coordinator_away_until = time.monotonic() + away_s
        log.warning("coordinator killed (ServerApp pids %s), away for %.0f s", pids, away_s)
        return pids

    def _serverapp_pids(self) -> list[int]:
        """The run's live ServerApp processes (Flower spawns them detached; they carry the run's marker)."""
        return [pid for pid in processes_with_env(RUN_MARKER_ENV, str(self.run_dir.path))
                if "flwr-serverapp" in _command_line(pid)]

    def end_coordinator_absence(self) -> None:
        """Let a coordinator killed by :meth:`kill_coordinator` come back now rather than after its `away_s`: a gossip
        run submits it again at its next look."""
        self.coordinator_away_until = time.monotonic()

    def _restart_coordinator(self) -> int:
        """Submit the run's app again as its next attempt (see the module docstring); Flower's new run id."""
        self.coordinator_restarts += 1
        attempt = int(self.run_dir.settings().get(SETTINGS_ATTEMPT, 1)) + 1
        self.run_dir.update_settings({SETTINGS_ATTEMPT: attempt})
        log.warning("the ServerApp died: submitting it again (attempt %d)", attempt)
        return self.submit()

    def write_flower_app(self, superlink_address: str, root_certificates: Path | None = None) -> None:
        """The run's Flower app folder and federation (see :func:`write_flower_app`)."""
        write_flower_app(self.run_dir, superlink_address, root_certificates)

    def start_flower(self) -> None:
        port = self.options.superlink_port
        self.write_flower_app(f"{self.coordinator_host}:{port}")
        start_superlink(self.processes, self.run_dir, self.coordinator_host, port)
        for index, dc in enumerate(self.config.datacenters):
            name = dc.name
            if self.network is None:  # each datacenter reaches the SuperLink through its own relay: emulated and measured
                self.relays[name] = LinkRelay(HOST, port, self.run_dir.link_ledger(name), link=dc.link,
                                              seed=self.config.run.seed * 100 + index).start()
            self._start_supernode(name)

    def submit(self) -> int:
        """Submit the app to the SuperLink; returns Flower's run id."""
        return submit_flower_app(self.run_dir, {protocol.RUN_DIR: str(self.run_dir.path)})

    # ------------------------------------------------------------ monitoring
    def flower_status(self, control: SuperLinkControl, flower_run_id: int) -> tuple[str, str]:
        """(status, details) of the run as Flower's SuperLink reports it, e.g. ("finished:failed", "ServerApp failed with …"),
        asked of its Control API from this process (a `flwr ls` would start a process and import Flower's CLI, about
        2 s of CPU, every FLOWER_CHECK_S); ("unknown", why) when the SuperLink does not answer."""
        try:
            return control.run_status(flower_run_id)
        except ControlError as err:
            return "unknown", str(err)[-200:]

    def wait(self, flower_run_id: int) -> dict[str, Any]:
        """Follow the run in SQL until it ends; report progress; fail fast if a process dies.

        A database that does not answer for a while is tolerated (the ServerApp buffers its
        writes). Flower's own view of the run is checked every FLOWER_CHECK_S: a ServerApp that
        ended without recording its end in SQL (it crashed before it could, or the database was
        gone) fails the run instead of leaving it, and this command, waiting forever.
        """
        engine = make_engine(self.options.db_url)
        control = (SuperLinkControl(self.options.superlink, self.options.superlink_ca,
                                    insecure=self.options.superlink_ca is None) if self.options.superlink is not None
                   else SuperLinkControl(f"{self.coordinator_host}:{self.options.superlink_port}", None, insecure=True))
        reported = 0
        next_flower_check = time.monotonic() + FLOWER_CHECK_S
        flower_ended_at: float | None = None
        # a local run also sees its ServerApp process: one seen and then gone counts as ended at once (Flower itself
        # may take tens of seconds to mark a killed ServerApp's run finished)
        next_process_check, serverapp_seen, serverapp_missing_since = time.monotonic(), False, None
        try:
            while True:
                for managed in self.processes.processes:
                    if managed.process.poll() is not None:
                        raise RunFailed(f"{managed.name} exited unexpectedly (code {managed.process.returncode}); see {managed.log_path}")
                # (not for gossip: its coordinator comes back when Flower says the old one ended, as its test expects)
                if self.options.superlink is None and not self.gossip and time.monotonic() >= next_process_check:
                    next_process_check = time.monotonic() + SERVERAPP_CHECK_S
                    if self._serverapp_pids():
                        serverapp_seen, serverapp_missing_since = True, None
                    elif serverapp_seen and flower_ended_at is None:
                        serverapp_missing_since = serverapp_missing_since or time.monotonic()
                        if time.monotonic() - serverapp_missing_since > FLOWER_END_GRACE_S:
                            flower_ended_at = serverapp_missing_since  # decide now, as if Flower had said so
                            next_flower_check = time.monotonic()
                if time.monotonic() >= next_flower_check:
                    next_flower_check = time.monotonic() + FLOWER_CHECK_S
                    status, details = self.flower_status(control, flower_run_id)
                    if status.startswith("finished") and flower_ended_at is None:  # e.g. "finished:failed"
                        flower_ended_at = time.monotonic()
                    if (flower_ended_at is not None and time.monotonic() - flower_ended_at > FLOWER_END_GRACE_S
                            and self.gossip and self.coordinator_restarts < MAX_COORDINATOR_RESTARTS):
                        try:
                            run = get_run(engine, self.run_id)
                        except OperationalError:
                            run = None  # the database does not answer: decide at the next check
                            flower_ended_at = time.monotonic()
                        if run and run["status"] == "running":  # killed: it recorded no end
                            if time.monotonic() < self.coordinator_away_until:
                                continue
                            flower_run_id, flower_ended_at = self._restart_coordinator(), None
                            serverapp_seen, serverapp_missing_since = False, None
                            continue
                    if flower_ended_at is not None and time.monotonic() - flower_ended_at > FLOWER_END_GRACE_S:
                        raise RunFailed(f"the ServerApp ended ({status}: {details}) without recording the end of run "
                                        f"{self.run_id}; see {self.run_dir.logs / 'superlink.log'}")
                try:
                    run = get_run(engine, self.run_id)
                    rounds = list_rounds(engine, self.run_id)
                except OperationalError:
                    time.sleep(1.0)
                    continue
                if self.options.progress and len(rounds) != reported:
                    reported = len(rounds)
                    self.options.progress(rounds)
                self.inject_faults(len(rounds))
                if run and run["status"] != "running":
                    if run["status"] != "finished":
                        raise RunFailed(f"run {self.run_id} {run['status']}: {run.get('error') or 'see the run log'}")
                    return dict(run.get("result") or {})
                time.sleep(0.3)
        finally:
            control.close()
            engine.dispose()

    def inject_faults(self, rounds_logged: int) -> None:
        """Apply the config's link faults whose round (or time since the run started) has come, each once, and record
        them as events."""
        elapsed = time.time() - self.started_at
        due = [(i, f) for i, f in enumerate(self.config.link_faults) if i not in self.faults_done and (
            rounds_logged >= f.after_round if f.after_round is not None else elapsed >= float(f.after_s or 0.0))]
        if not due:
            return
        with RunLog(self.options.db_url) as runlog:
            for index, fault in due:
                self.faults_done.add(index)
                detail: dict[str, Any] = {"seconds": fault.cut_s} if fault.kind == "cut" else {}
                if fault.between is not None:
                    detail["between"] = list(fault.between)
                if self.network is not None:
                    if fault.kind == "cut":
                        self.network.cut(fault.cut_s, datacenter=fault.datacenter, between=fault.between)
                    else:
                        self.network.reset(datacenter=fault.datacenter, between=fault.between)
                else:
                    assert fault.datacenter is not None  # mesh faults are refused without the namespace emulator
                    relay = self.relays[fault.datacenter]
                    if fault.kind == "cut":
                        relay.cut(fault.cut_s)
                    else:
                        relay.reset_connections()
                log.warning("link fault: %s on %s after round %d (%.1f s)", fault.kind, fault.target, rounds_logged, elapsed)
                runlog.log_event(run_id=self.run_id, kind=f"link-{fault.kind}", round=rounds_logged,
                                 datacenter=fault.datacenter, detail=detail)
            runlog.flush(timeout=10)

    # --------------------------------------------------------------- driver
    def execute(self) -> LocalRunResult:
        """Run the experiment to its end; always stop every process; never leave the run 'running'."""
        refuse_unsupported(self.config, self.options.engine, standing=self.options.superlink is not None)
        if self.options.superlink is not None:
            return self._execute_on_standing_federation()
        prepared = False
        try:
            self.prepare()
            prepared = True
            self.start_network()
            self.start_trainers()
            if self.options.engine == "simulation":
                summary = self._simulate()
            else:
                self.start_flower()
                flower_run_id = self.submit()
                summary = self.wait(flower_run_id)
                summary.setdefault("flower_run_id", str(flower_run_id))
            return LocalRunResult(self.run_id, summary, self.run_dir.path, dict(self.worker_pids), self.processes.pids())
        except KeyboardInterrupt:
            if prepared:  # recorded before the teardown, so the ServerApp's own view cannot overwrite it
                self._mark_ended("interrupted", "interrupted by the operator (Ctrl-C)")
            raise
        except Exception as err:
            if prepared:
                self._mark_ended("failed", f"{type(err).__name__}: {err}".splitlines()[0])
            raise
        finally:
            self.teardown()

    def _execute_on_standing_federation(self) -> LocalRunResult:
        """Submit to a running SuperLink whose SuperNodes (`crossdc node start`) bring their own trainers; follow
        the run in SQL. Ctrl-C (or `detach`) stops following, never the run."""
        assert self.options.superlink is not None
        self.prepare()
        self.write_flower_app(self.options.superlink, self.options.superlink_ca)
        try:
            flower_run_id = self.submit()
            with RunLog(self.options.db_url) as runlog:  # known at once, so the run can be stopped before it starts
                runlog.add_flower_run_id(run_id=self.run_id, flower_run_id=flower_run_id)
                runlog.flush(timeout=30)
        except Exception as err:
            self._mark_ended("failed", f"{type(err).__name__}: {err}".splitlines()[0])
            self._audit_submission("failed", {"reason": f"{type(err).__name__}: {err}".splitlines()[0]})
            raise
        self._audit_submission("ok", {"flower_run_id": str(flower_run_id)})
        if self.options.detach:
            return LocalRunResult(self.run_id, {"run_id": self.run_id, "flower_run_id": str(flower_run_id), "detached": True},
                                  self.run_dir.path)
        try:
            summary = self.wait(flower_run_id)
        except KeyboardInterrupt:
            raise Detached(self.run_id) from None
        summary.setdefault("flower_run_id", str(flower_run_id))
        return LocalRunResult(self.run_id, summary, self.run_dir.path)

    def _audit_submission(self, outcome: str, detail: dict[str, Any]) -> None:
        """One audit row for this run submitted (or resubmitted) to a standing federation on behalf of
        `options.audited_as` (none when that is None); a database that refuses it is logged, never fatal."""
        if self.options.audited_as is None:
            return
        action = "resume-run" if self.options.resume else "submit-run"
        detail = {"name": self.config.run.name, "strategy": self.config.strategy.name,
                  "superlink": self.options.superlink, **detail}
        engine = make_engine(self.options.db_url)
        try:
            record_audit_now(engine, action, outcome, actor=self.options.audited_as, target=self.run_id, detail=detail)
        except Exception as err:  # noqa: BLE001 - the run is submitted (or failed) whatever the audit log says
            log.warning("could not record %s of run %s in the audit log: %s", action, self.run_id, err)
        finally:
            engine.dispose()

    def teardown(self) -> None:
        """Stop every process of the run, including what Flower started detached; close the links."""
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} \
            if threading.current_thread() is threading.main_thread() else {}
        try:
            self.processes.stop_all()
            kill_processes_with_env(RUN_MARKER_ENV, str(self.run_dir.path))
            for relay in self.relays.values():
                relay.close()
            if self.network is not None:
                self.network.close()
            self.run_dir.remove_sockets()
            self._release_coordinator_file()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _release_coordinator_file(self) -> None:
        """This process coordinates the run no more: remove the run's coordinator file if it names this process (a
        resume may then start while this process lives on, e.g. a program that ran the run in-process)."""
        path = self.run_dir.path / COORDINATOR_PID_FILE
        try:
            if path.read_text().strip() in {process_identity(os.getpid()), str(os.getpid())}:
                path.unlink()
        except OSError:
            pass

    def _simulate(self) -> dict[str, Any]:
        from flwr.simulation import run_simulation

        from crossdc.clients.client_app import app as client_app
        from crossdc.federation.server_app import make_server_app

        # one Ray actor per datacenter (a ClientApp only waits on its datacenter's trainer): every datacenter can
        # have its task in flight at once, which an asynchronous strategy needs
        actors = max(2, len(self.config.datacenters))
        try:
            run_simulation(
                server_app=make_server_app(self.run_dir),
                client_app=client_app,
                num_supernodes=len(self.config.datacenters),
                backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                "init_args": {"num_cpus": actors, "include_dashboard": False,
                                              "_system_config": RAY_SYSTEM_CONFIG}},
            )
        except SystemExit as exit_:  # Flower ends the process on some errors (e.g. missing simulation extras)
            raise RunFailed(f"Flower's simulation engine exited with code {exit_.code}; see the log above") from None
        run = get_run_at(self.options.db_url, self.run_id)
        if not run or run["status"] != "finished":
            raise RunFailed(f"run {self.run_id} {run['status'] if run else 'missing'}: {(run or {}).get('error') or 'see the log'}")
        return dict(run.get("result") or {})

    def _mark_ended(self, status: str, error: str) -> None:
        """Record how the run ended if the ServerApp could not (it was killed, or never started)."""
        try:
            record_run_end(self.options.db_url, self.run_id, status, error)
        except (OperationalError, DatabaseUnavailable, TimeoutError) as err:
            log.warning("could not record that run %s %s: %s", self.run_id, status, err)


def record_run_end(db_url: str, run_id: str, status: str, error: str, event: str | None = None,
                   detail: Any = None) -> bool:
    """End a run that is still ``running`` in the run log as `status` (interrupted, failed) with `error`, and log the
    event `event` (default ``run-<status>``, detail `error` unless `detail` is given); True if it was running. The
    first final status wins (:meth:`RunLog.finish_run`), so a ServerApp ending later cannot overwrite it. Database
    errors (OperationalError, DatabaseUnavailable, TimeoutError) reach the caller."""
    run = get_run_at(db_url, run_id)
    if run is not None and run["status"] != "running":
        return False
    with RunLog(db_url) as runlog:
        runlog.log_event(run_id=run_id, kind=event or "run-" + status, detail=error if detail is None else detail)
        runlog.finish_run(run_id=run_id, status=status, error=error)
        runlog.flush(timeout=30)
    return True


def refuse_unsupported(config: ExperimentConfig, engine: str = "deployment", standing: bool = False) -> None:
    """RunFailed, with one line, if `config` cannot run this way: on `engine` (deployment or simulation), on a standing
    federation (`standing`: submitted to a SuperLink whose SuperNodes bring their own trainers) or here at all."""
    loop = strategy_class(config.strategy.name).loop
    if loop in ("gossip", "pipeline") and (standing or engine != "deployment"):
        raise RunFailed(f"strategy '{config.strategy.name}' ({loop}) runs on a local deployment only so far "
                        "(--engine deployment, no --superlink): on a standing federation or in Flower's simulation "
                        "it is not implemented yet")
    crowded = [dc.name for dc in config.datacenters if dc.workers != 1]
    if loop == "pipeline" and crowded:
        raise RunFailed(f"a pipeline stage runs on one worker: {', '.join(crowded)} have more (data parallel inside "
                        "a stage is not built yet)")
    if standing and engine != "deployment":
        raise RunFailed("a standing federation runs on Flower's Deployment Engine (--engine deployment)")
    if standing and (config.link_faults or config.links or any(dc.link for dc in config.datacenters)):
        raise RunFailed("links and link faults are emulated only for local runs; a standing federation has real links")


COORDINATOR_PID_FILE = "coordinator.pid"


def coordinator_alive(run_dir: RunDir) -> int | None:
    """The pid of the process coordinating the run in `run_dir` if it is still alive, else None. The file holds the
    coordinator's "PID:START" (processes.process_identity), so a recycled pid is not taken for it; a file of an older
    crossdc holds the pid alone, whose command line must then name crossdc."""
    try:
        text = (run_dir.path / COORDINATOR_PID_FILE).read_text().strip()
    except OSError:
        return None
    identity = parse_process_identity(text)
    if identity is not None:
        pid, start = identity
        return pid if pid != os.getpid() and same_process_alive(pid, start) else None
    if not text.isdigit():
        return None
    pid = int(text)
    if pid == os.getpid() or not is_running(pid):
        return None
    try:  # a recycled pid is not the coordinator
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return pid if "crossdc" in command else None


def checkpoint_url(directory: str, run_id: str) -> str:
    """Where a run's checkpoints go: `directory`/`run_id`, an fsspec URL as it is, a local path made absolute."""
    if "://" in directory:
        return f"{directory.rstrip('/')}/{run_id}"
    return str(Path(directory).resolve() / run_id)


def run_local(config: ExperimentConfig, options: LocalRunOptions) -> LocalRunResult:
    """Run `config` on this machine (see :class:`LocalRun`)."""
    return LocalRun(config, options).execute()

"""Shared fixtures: SQLite and PostgreSQL databases, and a TCP relay to cut a connection."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from crossdc.clients.channel import call_trainer
from crossdc.db.engine import make_engine, upgrade
from crossdc.db.queries import get_run, list_datacenter_rounds, list_events, list_rounds
from crossdc.experiment.processes import free_port, is_running, processes_with_env
from crossdc.experiment.rundir import RunDir
from crossdc.wan.network import namespaces_unavailable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tcp_relay import TcpRelay  # noqa: E402

#: what measures a local run's links here: the namespace emulator where it can run, else the relay fallback
COMM_SOURCE = "delay-line" if namespaces_unavailable() is None else "relay"


@pytest.fixture
def namespaces() -> None:
    """For tests that need the namespace emulator (`pytest.mark.usefixtures("namespaces")`, or namespaced.py's
    `needs_namespaces`): skipped with the reason where namespaces cannot be made; under CI, which runs as root, a
    machine without them is broken, so the test fails instead of skipping."""
    reason = namespaces_unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI cannot run the namespace emulator: {reason}", pytrace=False)
        pytest.skip(reason)

PG_ADMIN_URL = os.environ.get(
    "CROSSDC_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
PG_START_HINT = (
    "start it with: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start "
    "(or point CROSSDC_TEST_PG_ADMIN_URL at a server where this user may CREATE DATABASE)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test files whose longest test may run longest start first (with `--no-loadscope-reorder`, pytest-xdist hands
    out whole files in this order), so that the suite does not end waiting on one long file that started last.
    A test's `timeout` mark is its author's bound on how long it runs; a file counts by its longest."""
    default = float(config.getini("timeout") or 0)
    longest: dict[Path, float] = {}
    for item in items:
        mark = item.get_closest_marker("timeout")
        bound = float(mark.args[0]) if mark is not None and mark.args else default
        longest[item.path] = max(longest.get(item.path, 0.0), bound)
    items.sort(key=lambda item: -longest[item.path])  # stable: a file's own order is kept


def crossdc_executable() -> str:
    """The `crossdc` console script of this virtualenv (or on PATH)."""
    candidate = Path(sys.executable).with_name("crossdc")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("crossdc")
    assert found, "the crossdc console script is not installed"
    return found


CROSSDC = crossdc_executable()


def client_app_altering_replies(alter: Any) -> Any:
    """The real ClientApp, except that `alter(datacenter, reply)` may change each train reply on its way out
    (a datacenter that sends something broken)."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    from crossdc.clients import client_app as real
    from crossdc.protocol import CONFIG_KEY, DATACENTER

    app = ClientApp()

    @app.query()
    def hello(msg: Message, context: Context) -> Message:
        return real.hello(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = real.train(msg, context)
        alter(str(msg.content[CONFIG_KEY][DATACENTER]), reply)
        return reply

    return app


def interruptible() -> None:
    """preexec_fn for a child the test will Ctrl-C: SIGINT handled by default even when the test run itself was
    started with SIGINT ignored (a background job of a non-interactive shell, nohup)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def streaming_toml(*, name: str, rounds: int, tau: int, params: str, speed: float, link: str | None = None,
                   extra: str = "", deadline: str | None = None) -> str:
    """The experiment the streaming tests run: two datacenters (us-east, eu-west) training the synthetic MLP with
    AdamW under Streaming DiLoCo with `params` (a TOML inline table), each at `speed` behind `link` (none: loopback),
    with `extra` TOML appended (sections of its own); exchanges wait 300 s, or by the adaptive `deadline` (an inline
    table) if given."""
    link_line = f'link = "{link}"\n' if link else ""
    datacenters = "".join(f'\n[[datacenters]]\nname = "{dc}"\n{link_line}speed = {speed:g}\n' for dc in ("us-east", "eu-west"))
    wait = f"deadline = {deadline}" if deadline else "round_timeout_s = 300"
    return (f'[run]\nname = "{name}"\nrounds = {rounds}\nseed = 0\n{wait}\n\n'
            '[workload]\ndataset = "synthetic"\nmodel = "mlp"\npartition = { kind = "iid" }\nbatch_size = 16\n'
            'optimizer = "adamw"\nlr = 0.01\n\n'
            f'[strategy]\nname = "streaming-diloco"\ntau = {tau}\nparams = {params}\n{extra}{datacenters}')


def read_run(db_url: str, run_id: str) -> dict[str, Any]:
    """Everything the run log holds about one run: run, rounds, dc_rounds, events (plain dicts)."""
    engine = make_engine(db_url)
    try:
        return {"run": get_run(engine, run_id), "rounds": list_rounds(engine, run_id),
                "dc_rounds": list_datacenter_rounds(engine, run_id), "events": list_events(engine, run_id)}
    finally:
        engine.dispose()


def rounds_logged(db_url: str, run_id: str) -> int:
    """How many ``rounds`` rows (versions, for an asynchronous run) the run has logged; 0 while it cannot be read."""
    try:
        return len(read_run(db_url, run_id)["rounds"])
    except Exception:
        return 0


def processes_mentioning(*texts: str) -> list[str]:
    """"pid: command line" of live processes (not this one) whose command line contains every one of `texts`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(text in cmdline for text in texts) and is_running(int(entry.name)):
            found.append(f"{entry.name}: {cmdline}")
    return found


def via_relay(url: str, relay: TcpRelay) -> str:
    """The same database URL, reaching the server through `relay`."""
    return make_url(url).set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'crossdc.db'}"


@pytest.fixture
def migrated_sqlite_url(sqlite_url: str) -> str:
    upgrade(sqlite_url)
    return sqlite_url


def _pg_admin():  # type: ignore[no-untyped-def]
    import psycopg

    url = make_url(PG_ADMIN_URL)
    kwargs = {
        "host": url.host or "127.0.0.1",
        "port": url.port or 5432,
        "user": url.username or "postgres",
        "dbname": url.database or "test",
        "autocommit": True,
        "connect_timeout": 5,
    }
    if url.password:
        kwargs["password"] = url.password
    try:
        return psycopg.connect(**kwargs), url
    except psycopg.OperationalError as e:
        problem = " ".join(str(e).split())
    pytest.fail(
        f"PostgreSQL is not reachable at {url.render_as_string(hide_password=True)}: {problem}; "
        f"{PG_START_HINT}",
        pytrace=False,
    )


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database (dropped afterwards); a fresh schema if CREATE DATABASE is denied."""
    import psycopg

    conn, admin = _pg_admin()
    name = f"crossdc_test_{uuid.uuid4().hex[:12]}"
    mode = "database"
    try:
        conn.execute(f'CREATE DATABASE "{name}"')
        url = admin.set(drivername="postgresql+psycopg", database=name)
    except psycopg.errors.InsufficientPrivilege:
        mode = "schema"
        conn.execute(f'CREATE SCHEMA "{name}"')
        url = admin.set(drivername="postgresql+psycopg", query={"options": f"-csearch_path={name}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        if mode == "database":
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        else:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        conn.close()


@pytest.fixture
def migrated_pg_url(pg_url: str) -> str:
    upgrade(pg_url)
    return pg_url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def migrated_url(request: pytest.FixtureRequest) -> str:
    name = "migrated_sqlite_url" if request.param == "sqlite" else "migrated_pg_url"
    return request.getfixturevalue(name)


@pytest.fixture
def relay() -> Iterator[TcpRelay]:
    admin = make_url(PG_ADMIN_URL)
    r = TcpRelay(admin.host or "127.0.0.1", admin.port or 5432).start()
    try:
        yield r
    finally:
        r.close()


def _via(url: str, relay: TcpRelay) -> str:
    return make_url(url).set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False)




class AuthenticatingSuperLink:
    """A real flower-superlink with SuperNode authentication (so TLS, with `crossdc certs` certificates) on a free
    loopback port, that can be stopped and started again on the same port; with `database`, its state (registered
    nodes, runs) is kept there (`flower-superlink --database`), else in its memory."""

    def __init__(self, directory: Path, database: Path | None = None) -> None:
        from crossdc.deployment.tls import make_certificates
        from crossdc.experiment.processes import ProcessGroup

        self.directory, self.database = directory, database
        self.certs = make_certificates(directory / "certs", ["127.0.0.1", "localhost"])
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.processes = ProcessGroup()

    def start(self) -> None:
        from crossdc.experiment.processes import flower_env, wait_for_port

        certs = self.certs
        state = ["--database", str(self.database)] if self.database is not None else []
        superlink = self.processes.start("superlink", [str(Path(sys.executable).with_name("flower-superlink")),
                                                       "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
                                                       "--ssl-ca-certfile", str(certs.ca_cert), "--enable-supernode-auth",
                                                       "--disable-runtime-dependency-installation", *state, "--host", "127.0.0.1",
                                                       "--port", str(self.port)], self.directory / "superlink.log",
                                         env=flower_env(self.directory / "flwr-home"))
        wait_for_port("127.0.0.1", self.port, 60, alive=superlink)

    def stop(self) -> None:
        """SIGTERM (what `docker compose restart` sends), SIGKILL after 10 s."""
        self.processes.stop_all()

    def kill(self) -> None:
        """SIGKILL, a crash (its database, if any, as the crash left it)."""
        self.processes.kill("superlink")


@contextlib.contextmanager
def authenticating_superlink(directory: Path) -> Iterator[tuple[str, Any]]:
    """A real flower-superlink with SuperNode authentication (so TLS, with `crossdc certs` certificates) on a free
    loopback port; yields its address and the certificate paths, and stops it afterwards."""
    superlink = AuthenticatingSuperLink(directory)
    try:
        superlink.start()
        yield superlink.address, superlink.certs
    finally:
        superlink.stop()


#: how long after `crossdc run` is killed its last process may still run in run_and_kill_when: the promise is 3 s
#: (crossdc.experiment.processes.die_with_run_root); this bound is generous for a loaded machine, and still far below
#: the tens of seconds an orphaned ServerApp or SuperExec lived before it was kept
LEFTOVERS_GONE_S = 10.0


def process_tree(marker: str, value: str) -> list[str]:
    """"pid (parent ppid): command line" of every live process whose environment has marker=value (not this one)."""
    found = []
    for pid in processes_with_env(marker, value):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append(f"{pid} (parent {stat[1]}): {cmdline[:200]}")
    return found


def run_and_kill_when(config: Path, db_url: str, runs: Path, env: dict[str, str], ready: Callable[[str], bool],
                       within_s: float, poll_s: float, marker: str) -> str:
    """Start `crossdc run config` in a process group of its own, SIGKILL the whole group once `ready(run_id)` holds
    (within `within_s`: what a crashed shell, the OOM killer or a lost terminal does), and return the run's id; fails
    if the run ended first, or if any process of the run (found by `marker`, an environment variable of `env` that
    every process of the run inherits) is still running LEFTOVERS_GONE_S after the kill. Before the kill they must
    include the ServerApp, the trainers and the SuperNodes, which crossdc run does not start itself."""
    coordinator = subprocess.Popen([CROSSDC, "run", str(config), "--db", db_url, "--port", str(free_port()),
                                    "--runs-dir", str(runs)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   env=env, start_new_session=True)
    deadline = time.monotonic() + within_s
    run_id = None
    while time.monotonic() < deadline and coordinator.poll() is None:
        folders = [p.name for p in runs.glob("*") if p.is_dir()] if runs.exists() else []
        run_id = folders[0] if folders else None
        if run_id and ready(run_id):
            break
        time.sleep(poll_s)
    assert run_id and coordinator.poll() is None, "the run ended before it could be interrupted"
    before = process_tree(marker, env[marker])
    os.killpg(coordinator.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    coordinator.wait(timeout=30)
    for part in ("flwr-serverapp", "crossdc.clients.trainer", "crossdc.clients.supernode"):
        assert any(part in line for line in before), f"no {part} among the run's processes:\n" + "\n".join(before)
    left = process_tree(marker, env[marker])
    while left and time.monotonic() - killed_at < LEFTOVERS_GONE_S:
        time.sleep(0.05)
        left = process_tree(marker, env[marker])
    gone_s = time.monotonic() - killed_at
    assert not left, (f"{len(left)} process(es) of the run outlived it by {LEFTOVERS_GONE_S:g} s:\n" + "\n".join(left)
                      + "\nbefore the kill:\n" + "\n".join(before))
    print(f"all {len(before)} processes of run {run_id} gone {gone_s:.2f} s after the kill")
    return run_id


class TrainerService:
    """The real persistent trainer of datacenter dc-a of run group-test, started as `crossdc run` starts it
    (`settings`: more keys of the run's settings)."""

    def __init__(self, root: Path, doc: dict, **settings: Any) -> None:
        self.run_dir = RunDir(root)
        self.run_dir.create({"run_id": "group-test", "db_url": "sqlite://", "config": doc, **settings})
        self.process = subprocess.Popen([sys.executable, "-m", "crossdc.clients.trainer", "--run-dir", str(root), "--datacenter", "dc-a"],
                                        stdout=open(root / "trainer.log", "wb"), stderr=subprocess.STDOUT)

    def call(self, request: dict) -> dict:
        return call_trainer(self.run_dir.trainer_socket("dc-a"), self.run_dir.authkey(), request, connect_timeout_s=120)

    def close(self) -> None:
        """SIGTERM, as `crossdc run` stops a trainer; a trainer still running 120 s later (a busy machine's slowest
        shutdown was about a minute) is killed and the test fails with its log's tail."""
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
            log = (self.run_dir.path / "trainer.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"the trainer did not stop within 120 s of SIGTERM; its log ends:\n{log}")
        finally:
            self.run_dir.remove_sockets()


def kill_stage_then_resume(config: Any, root: Path, db_url: str, victim: str, after_round: int) -> dict[str, Any]:
    """Run `config` on the Deployment Engine with `victim`'s trainer (and SuperNode) killed once `after_round` rounds
    are logged, which must fail the run; then `crossdc resume` it. Returns the run id, the failure's text, the
    failed run's log (read_run) and the resume's CompletedProcess (its summary is the last line of stdout, --json)."""
    from crossdc.orchestration.local_run import LocalRun, LocalRunOptions, RunFailed

    class KilledRun(LocalRun):
        def inject_faults(self, rounds_logged: int) -> None:
            super().inject_faults(rounds_logged)
            if rounds_logged >= after_round and not getattr(self, "killed", False):
                self.killed = True
                self.kill_datacenter(victim, trainer=True)

    run = KilledRun(config, LocalRunOptions(db_url=db_url, engine="deployment", superlink_port=free_port(),
                                            runs_root=root))
    with pytest.raises(RunFailed) as failure:
        run.execute()
    failed = read_run(db_url, run.run_id)
    resumed = subprocess.run([crossdc_executable(), "resume", run.run_id, "--db", db_url, "--runs-dir", str(root),
                              "--port", str(free_port()), "--json"], capture_output=True, text=True, timeout=400)
    return {"run_id": run.run_id, "failure": str(failure.value), "failed": failed, "resumed": resumed}

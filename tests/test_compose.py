"""compose.yaml: valid for Docker Compose (Debian's docker-compose validates it without an engine); read against what
each process needs on a real host (its writable paths on volumes the image's user owns, the ports datacenters reach,
the CA's key only where certificates are made, a required database password, real health checks, the API able to
take runs); and every crossdc service's command, run natively with the container paths, host names and ports mapped
onto this machine, does its job: certificates, migrations, the authenticating SuperLink with its state in a database,
the front, the API, a datacenter's enrollment and node. Each service's health check passes once it is up."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from crossdc.db.engine import make_engine
from crossdc.db.security import create_token
from crossdc.deployment.heartbeat import HEARTBEAT_PORTS_ENV, HeartbeatMonitor, heartbeat_ports
from crossdc.deployment.superlink_control import SuperLinkControl
from crossdc.experiment.config import CheckpointSection
from crossdc.experiment.processes import ProcessGroup, flower_env, free_port, kill_processes_with_env, venv_bin, wait_for_port
from crossdc.orchestration.submission import confine_checkpoint_dir, resolve_checkpoint_roots

REPO = Path(__file__).resolve().parents[1]
MARKER = "CROSSDC_TEST_COMPOSE"
OPERATOR = ("certs", "migrate", "superlink", "front", "api")
DATACENTER = ("enroll", "datacenter")
#: what compose needs to resolve the file (the password is required)
REQUIRED = {"POSTGRES_PASSWORD": "compose-test-password"}
#: the long-lived services (they restart) and what each one's health check must run: a real request, not a connect
HEALTH_CHECKS = {"superlink": ["python", "-m", "crossdc.deployment.health", "superlink"],
                 "front": ["python", "-m", "crossdc.deployment.health", "front"],
                 "api": ["python", "-m", "crossdc.deployment.health", "api"],
                 "datacenter": ["crossdc", "node", "health"]}


def compose_config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`docker-compose -f compose.yaml config` with `env` (and nothing of this virtualenv)."""
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose is not installed (apt-get install docker-compose; .ci/run does it)"
    # Debian's docker-compose is a script of the system Python: run it isolated from this virtualenv's packages
    # (-I, and an environment without PYTHON* variables), whatever started the tests
    with open(tool, "rb") as script:
        shebang = script.readline().decode(errors="replace")
    command = [shebang[2:].strip(), "-I", tool] if shebang.startswith("#!") and "python" in shebang else [tool]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    clean["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    return subprocess.run([*command, "-f", str(REPO / "compose.yaml"), "config"], capture_output=True, text=True,
                          timeout=120, env={**clean, **env}, cwd=REPO)


def resolved_compose(env: dict[str, str]) -> dict[str, Any]:
    """compose.yaml as `docker-compose config` resolves it (variables, anchors), or a test failure saying why."""
    done = compose_config({**REQUIRED, **env})
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def option(command: list[str], name: str) -> str | None:
    """The value of `--name VALUE` in a command line (the last one), or None."""
    values = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == name]
    return values[-1] if values else None


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """A service's volume mounts: container path → (named volume, writable)."""
    found = {}
    for entry in service.get("volumes", []):
        source, target, *mode = entry.split(":") if isinstance(entry, str) else (entry["source"], entry["target"])
        found[target] = (source, "ro" not in mode)
    return found


def on_volume(path: str, service: dict[str, Any], writable: bool = True) -> str | None:
    """The named volume of `service` that holds container path `path` (writable, if asked), or None."""
    holders = [(target, volume) for target, (volume, rw) in mounts(service).items()
               if (rw or not writable) and PurePosixPath(path).is_relative_to(target)]
    return max(holders, key=lambda held: len(held[0]))[1] if holders else None


def dockerfile_image_user(text: str) -> tuple[str, str | None, set[str], str]:
    """What the Dockerfile says about its user: (the user the image runs as, the uid it was made with, the folders its
    RUN lines `chown -R` to it, the last WORKDIR)."""
    lines = text.replace("\\\n", " ").splitlines()  # continuation lines joined
    user = [line.split()[1] for line in lines if line.startswith("USER ")][-1]
    workdir = [line.split()[1] for line in lines if line.startswith("WORKDIR ")][-1]
    uid, chowned = None, set()
    for line in lines:
        for part in line.removeprefix("RUN ").split("&&") if line.startswith("RUN ") else []:
            words = part.split()
            if words[:1] == ["useradd"] and words[-1] == user and "--uid" in words:
                uid = words[words.index("--uid") + 1]
            if words[:2] == ["chown", "-R"] and words[2] == f"{user}:{user}":
                chowned.update(words[3:])
    return user, uid, chowned, workdir


class NativeMap:
    """Container paths, service host names and ports, mapped onto this machine."""

    def __init__(self, tmp: Path, state_root: Path | None = None) -> None:
        """`state_root` holds each service's /var/lib/crossdc (default `tmp`): keep it short, as the container's
        path is, so that the node's socket stays where its health check looks (a long path moves it to /tmp)."""
        self.paths = {"/certs": tmp / "certs", "/private-ca": tmp / "private-ca", "/srv/crossdc": tmp / "srv-crossdc"}
        self.ports = {"9093": str(free_port()), "9092": str(free_port()), "8443": str(free_port())}
        self.tmp = tmp
        self.state_root = state_root or tmp

    def argument(self, text: str, service: str) -> str:
        for container, host in self.paths.items():
            text = text.replace(container, str(host))
        text = text.replace("/var/lib/crossdc", str(self.state_dir(service)))
        for name in ("superlink", "front", "api"):
            text = text.replace(f"{name}:", "127.0.0.1:")
        text = text.replace("localhost:", "127.0.0.1:").replace("0.0.0.0", "127.0.0.1")
        for port, native in self.ports.items():
            text = text.replace(port, native)
        return text

    def state_dir(self, service: str) -> Path:
        """Where the service's /var/lib/crossdc is here (the enrollment's is the datacenter's: one volume)."""
        return self.state_root / f"{'datacenter' if service == 'enroll' else service}-state"

    def command(self, service: dict[str, Any], name: str) -> list[str]:
        args = [self.argument(str(a), name) for a in service["command"]]
        # the image's executables are this virtualenv's
        return [venv_bin(args[0]) if args[0] in ("crossdc", "flower-superlink", "python") else args[0], *args[1:]]

    def healthcheck(self, service: dict[str, Any], name: str) -> list[str] | None:
        test = service.get("healthcheck", {}).get("test")
        if not test:
            return None
        assert test[0] == "CMD", test
        return self.command({"command": test[1:]}, name)

    def prepare(self, service: dict[str, Any], name: str) -> Path | None:
        """Make the service's volumes' folders here (a fresh volume is an empty folder); its working folder, if any."""
        for target in mounts(service):
            Path(self.argument(target, name)).mkdir(parents=True, exist_ok=True)
        workdir = service.get("working_dir")
        return Path(self.argument(workdir, name)) if workdir else None


def _until(check: list[str], env: dict[str, str], within_s: float) -> subprocess.CompletedProcess[str]:
    """Run a health check until it passes or `within_s` passed; its last result."""
    deadline = time.monotonic() + within_s
    while True:
        done = subprocess.run(check, capture_output=True, text=True, timeout=30, env=env)
        if done.returncode == 0 or time.monotonic() > deadline:
            return done
        time.sleep(1)


@pytest.mark.deployment
def test_compose_gives_each_process_what_it_needs() -> None:
    compose = resolved_compose({"CROSSDC_PUBLIC_HOST": "ops.example.org", "CROSSDC_DATACENTER": "dc-compose"})
    services = compose["services"]
    crossdc = {name: s for name, s in services.items() if s.get("image") == "crossdc:latest"}
    assert set(crossdc) == {*OPERATOR, *DATACENTER}
    commands = {name: [str(a) for a in s["command"]] for name, s in crossdc.items()}
    superlink, api, front, node = (commands[name] for name in ("superlink", "api", "front", "datacenter"))

    # the database password is required (no silent default), and the services that use it get it
    missing = compose_config({})
    assert missing.returncode != 0 and "POSTGRES_PASSWORD" in missing.stderr
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == REQUIRED["POSTGRES_PASSWORD"]
    for name in ("migrate", "api", "superlink"):
        assert f":{REQUIRED['POSTGRES_PASSWORD']}@postgres:" in crossdc[name]["environment"]["CROSSDC_DATABASE_URL"], name
    assert "CROSSDC_DATABASE_URL" not in crossdc["front"].get("environment", {})  # the internet-facing door has none

    # the image's user owns every folder a service writes (a fresh named volume takes the image folder's owner), and
    # every such folder is on a volume: the SuperLink's database, the run folders and checkpoints the API writes and
    # the SuperLink's ServerApp reads and writes, certificates, the node's state
    user, uid, chowned, workdir = dockerfile_image_user((REPO / "Dockerfile").read_text())
    assert user == "crossdc" and uid == "10001", (user, uid)
    assert any(PurePosixPath(workdir).is_relative_to(folder) for folder in chowned), workdir

    def owned(path: str) -> bool:
        return any(PurePosixPath(path).is_relative_to(folder) for folder in chowned)

    written = {"superlink": [option(superlink, "--database"), crossdc["superlink"]["working_dir"]],
               "api": [option(api, "--runs-dir"), crossdc["api"]["working_dir"]],
               "certs": ["/certs", "/private-ca"],
               "enroll": [option(commands["enroll"], "--state-dir")],
               "datacenter": [option(node, "--state-dir")]}
    for name, paths in written.items():
        for path in paths:
            assert path and owned(path), (name, path, chowned)
            if path != crossdc[name].get("working_dir"):
                assert on_volume(path, crossdc[name]), (name, path)
    assert on_volume(option(superlink, "--database") or "", crossdc["superlink"]) == "superlink-state"
    # the ServerApp (started by the SuperLink) opens a run's folder and writes its checkpoints at the paths the API
    # recorded: the API's --runs-dir, and a config's default checkpoint.dir confined under its --checkpoint-root, on
    # volumes the SuperLink shares
    runs_dir = option(api, "--runs-dir") or ""
    roots = resolve_checkpoint_roots([root for i, root in enumerate(api[1:]) if api[i] == "--checkpoint-root"],
                                     Path(runs_dir))
    checkpoints = confine_checkpoint_dir(CheckpointSection().dir, roots)
    assert on_volume(checkpoints, crossdc["api"]) == "checkpoints", checkpoints
    for path in (runs_dir, checkpoints):
        assert path and on_volume(path, crossdc["api"]) == on_volume(path, crossdc["superlink"]) is not None, path
        assert owned(path), path
    assert crossdc["api"]["working_dir"] == crossdc["superlink"]["working_dir"]

    # the API takes runs: it submits to the SuperLink's private address, over TLS
    assert option(api, "--superlink") == "superlink:" + option(superlink, "--port")  # type: ignore[operator]
    assert option(api, "--superlink-ca") == option(superlink, "--ssl-ca-certfile")

    # the CA's key stays where certificates are made: only the certs service mounts the private CA, which it makes
    # there, and it copies the CA's certificate and the server's pair (never ca.key) to the certs volume
    assert {name for name, s in crossdc.items() if "private-ca" in {v for v, _ in mounts(s).values()}} == {"certs"}
    made = commands["certs"][-1]
    assert "--out /private-ca" in made and "ca.key" not in made and "/certs/" in made
    assert services["certs"].get("network_mode") == "none"
    assert all(not rw for name in ("front", "api") for volume, rw in mounts(crossdc[name]).values() if volume == "certs")

    # ports: datacenters reach the front (TCP), the API (TCP) and the coordinator's UDP heartbeat, whose ports the
    # ServerApp takes from the range the SuperLink's service publishes; nothing else is published
    published = {name: {(str(p["published"]), p.get("protocol", "tcp")) for p in s.get("ports", [])}
                 for name, s in services.items() if s.get("ports")}
    heartbeat = heartbeat_ports(crossdc["superlink"]["environment"][HEARTBEAT_PORTS_ENV])
    assert published == {"front": {(option(front, "--listen").rpartition(":")[2], "tcp")},  # type: ignore[union-attr]
                         "api": {(option(api, "--port"), "tcp")},
                         "superlink": {(str(port), "udp") for port in heartbeat}}, published
    assert all(str(p["target"]) == str(p["published"]) for p in services["superlink"]["ports"])  # hellos offer the port
    # the SuperLink's TCP port stays internal: its only other network carries nobody else
    outside = [n for n in services["superlink"]["networks"] if not compose["networks"][n].get("internal")]
    assert len(outside) == 1 and [name for name, s in services.items() if outside[0] in s.get("networks", {})] == ["superlink"]
    assert option(node, "--superlink") == option(commands["enroll"], "--front") == "ops.example.org:9092"

    # a datacenter's node trains on every GPU of its host
    devices = services["datacenter"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]

    # health checks ask each long-lived service a real question (never a bare connect or a socket file)
    long_lived = {name for name, s in crossdc.items() if s.get("restart") != "no"}
    assert long_lived == set(HEALTH_CHECKS)
    for name, start in HEALTH_CHECKS.items():
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:len(start) + 1] == start, (name, test)
        assert "socket" not in " ".join(test) and "test -S" not in " ".join(test)


def test_the_published_heartbeat_ports_are_the_coordinators(monkeypatch: pytest.MonkeyPatch) -> None:
    """A standing federation's coordinator (a heartbeat monitor asked for port 0) takes its port from the range the
    SuperLink's service publishes; a bad range is an OSError naming it."""
    spec = resolved_compose({})["services"]["superlink"]["environment"][HEARTBEAT_PORTS_ENV]
    monkeypatch.setenv(HEARTBEAT_PORTS_ENV, spec)
    monitor = HeartbeatMonitor("127.0.0.1", 0, "run-1", b"k" * 32, ["us-east"], timeout_s=1, on_change=lambda *_: None)
    try:
        assert monitor.port in heartbeat_ports(spec)
    finally:
        monitor.stop()
    monkeypatch.setenv(HEARTBEAT_PORTS_ENV, "9300-9200")
    with pytest.raises(OSError, match=HEARTBEAT_PORTS_ENV):
        HeartbeatMonitor("127.0.0.1", 0, "run-1", b"k" * 32, ["us-east"], timeout_s=1, on_change=lambda *_: None)


@pytest.mark.deployment
@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_compose_file_is_valid_and_every_service_command_runs(tmp_path: Path, pg_url: str) -> None:
    compose = resolved_compose({"CROSSDC_PUBLIC_HOST": "localhost", "CROSSDC_DATACENTER": "dc-compose"})
    services = compose["services"]
    assert set(services) == {"postgres", *OPERATOR, *DATACENTER}
    assert all("build" in services[name] for name in (*OPERATOR, *DATACENTER))
    assert (REPO / services["api"]["build"]["context"] / "Dockerfile").is_file()
    copied = [source for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
              for source in line.split()[1:-1]]
    assert {"pyproject.toml", "alembic.ini", "crossdc", "migrations"} <= set(copied)
    assert all((REPO / source).exists() for source in copied), copied

    state_root = Path(tempfile.mkdtemp(prefix="crossdc-compose-"))
    native = NativeMap(tmp_path, state_root)
    env = {**flower_env(tmp_path / "flwr-home"), "CROSSDC_DATABASE_URL": pg_url, MARKER: str(tmp_path)}
    processes = ProcessGroup()
    control = None
    try:
        for name in ("certs", "migrate"):  # one-shot services
            native.prepare(services[name], name)
            done = subprocess.run(native.command(services[name], name), capture_output=True, text=True, timeout=120, env=env)
            assert done.returncode == 0, (name, done.stderr[-2000:])
        assert sorted(p.name for p in (tmp_path / "certs").iterdir()) == ["ca.pem", "server.key", "server.pem"]
        assert (tmp_path / "private-ca" / "ca.key").is_file()
        for name, port in (("superlink", "9093"), ("front", "9092"), ("api", "8443")):
            cwd = native.prepare(services[name], name)
            started = processes.start(name, native.command(services[name], name), tmp_path / f"{name}.log", env=env, cwd=cwd)
            wait_for_port("127.0.0.1", int(native.ports[port]), 90, alive=started)
        for name in ("superlink", "front", "api"):
            check = native.healthcheck(services[name], name)
            assert check is not None
            done = _until(check, env, 30)
            assert done.returncode == 0, (name, done.stdout, done.stderr)
        assert (native.state_dir("superlink") / "superlink.db").is_file()  # the SuperLink keeps its state there

        # a datacenter enrolls with an enrollment token and starts its node; the SuperLink sees it online
        token = create_token(make_engine(pg_url), "compose-enroll", "enrollment")
        native.prepare(services["enroll"], "enroll")
        enrolled = subprocess.run(native.command(services["enroll"], "enroll"), capture_output=True, text=True,
                                  timeout=120, env={**env, "CROSSDC_ENROLLMENT_TOKEN": token})
        assert enrolled.returncode == 0, enrolled.stderr[-2000:]
        node = processes.start("datacenter", native.command(services["datacenter"], "datacenter"),
                               tmp_path / "datacenter.log", env=env)
        control = SuperLinkControl(f"127.0.0.1:{native.ports['9093']}", tmp_path / "certs" / "ca.pem")
        deadline = time.monotonic() + 60
        while "online" not in control.nodes().values():
            assert node.process.poll() is None, (tmp_path / "datacenter.log").read_text()[-2000:]
            assert time.monotonic() < deadline, control.nodes()
            time.sleep(0.5)
        check = native.healthcheck(services["datacenter"], "datacenter")
        assert check is not None
        done = _until(check, env, 30)
        assert done.returncode == 0, (done.stdout, done.stderr)
    finally:
        if control is not None:
            control.close()
        processes.stop_all()
        kill_processes_with_env(MARKER, str(tmp_path))
        shutil.rmtree(state_root, ignore_errors=True)

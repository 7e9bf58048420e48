"""compose.yaml: valid for Docker Compose (Debian's docker-compose validates it without an engine), and every crossdc
service's command, run natively with the container paths, host names and ports mapped onto this machine, does its
job: certificates, migrations, the authenticating SuperLink, the front, the API, a datacenter's enrollment and node.
Each service's health check passes once it is up."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from crossdc.db.engine import make_engine
from crossdc.db.security import create_token
from crossdc.deployment.superlink_control import SuperLinkControl
from crossdc.experiment.processes import ProcessGroup, flower_env, free_port, kill_processes_with_env, venv_bin, wait_for_port

REPO = Path(__file__).resolve().parents[1]
MARKER = "CROSSDC_TEST_COMPOSE"
OPERATOR = ("certs", "migrate", "superlink", "front", "api")
DATACENTER = ("enroll", "datacenter")


def resolved_compose(env: dict[str, str]) -> dict[str, Any]:
    """compose.yaml as `docker-compose config` resolves it (variables, anchors), or a test failure saying why."""
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose is not installed (apt-get install docker-compose; .ci/run does it)"
    # Debian's docker-compose is a script of the system Python: run it isolated from this virtualenv's packages
    # (-I, and an environment without PYTHON* variables), whatever started the tests
    with open(tool, "rb") as script:
        shebang = script.readline().decode(errors="replace")
    command = [shebang[2:].strip(), "-I", tool] if shebang.startswith("#!") and "python" in shebang else [tool]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    clean["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    done = subprocess.run([*command, "-f", str(REPO / "compose.yaml"), "config"], capture_output=True, text=True,
                          timeout=120, env={**clean, **env}, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


class NativeMap:
    """Container paths, service host names and ports, mapped onto this machine."""

    def __init__(self, tmp: Path, state_root: Path | None = None) -> None:
        """`state_root` holds each service's /var/lib/crossdc (default `tmp`): keep it short, as the container's
        path is, so that the node's socket stays where its health check looks (a long path moves it to /tmp)."""
        self.paths = {"/certs": tmp / "certs", "/checkpoints": tmp / "checkpoints"}
        self.ports = {"9093": str(free_port()), "9092": str(free_port()), "8443": str(free_port())}
        self.tmp = tmp
        self.state_root = state_root or tmp

    def argument(self, text: str, service: str) -> str:
        for container, host in self.paths.items():
            text = text.replace(container, str(host))
        text = text.replace("/var/lib/crossdc", str(self.state_root / f"{service}-state"))
        for name in ("superlink", "front", "api"):
            text = text.replace(f"{name}:", "127.0.0.1:")
        text = text.replace("localhost:", "127.0.0.1:").replace("0.0.0.0", "127.0.0.1")
        for port, native in self.ports.items():
            text = text.replace(port, native)
        return text

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


@pytest.mark.deployment
@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_compose_file_is_valid_and_every_service_command_runs(tmp_path: Path, pg_url: str) -> None:
    compose = resolved_compose({"CROSSDC_PUBLIC_HOST": "localhost", "CROSSDC_DATACENTER": "dc-compose"})
    services = compose["services"]
    assert set(services) == {"postgres", *OPERATOR, *DATACENTER}
    # only the front and the API are published; the SuperLink stays on the internal network
    assert {name for name, s in services.items() if s.get("ports")} == {"front", "api"}
    assert compose["networks"]["internal"]["internal"] is True and services["superlink"]["networks"] == {"internal": None}
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
            done = subprocess.run(native.command(services[name], name), capture_output=True, text=True, timeout=120, env=env)
            assert done.returncode == 0, (name, done.stderr[-2000:])
        assert (tmp_path / "certs" / "ca.pem").is_file()
        for name, port in (("superlink", "9093"), ("front", "9092"), ("api", "8443")):
            started = processes.start(name, native.command(services[name], name), tmp_path / f"{name}.log", env=env)
            wait_for_port("127.0.0.1", int(native.ports[port]), 90, alive=started)
        for name in ("superlink", "front", "api"):
            check = native.healthcheck(services[name], name)
            assert check is not None
            assert subprocess.run(check, capture_output=True, timeout=30, env=env).returncode == 0, name

        # a datacenter enrolls with an enrollment token and starts its node; the SuperLink sees it online
        token = create_token(make_engine(pg_url), "compose-enroll", "enrollment")
        enrolled = subprocess.run(native.command(services["enroll"], "datacenter"), capture_output=True, text=True,
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
        assert check is not None and subprocess.run(check, timeout=30).returncode == 0
    finally:
        if control is not None:
            control.close()
        processes.stop_all()
        kill_processes_with_env(MARKER, str(tmp_path))
        shutil.rmtree(state_root, ignore_errors=True)

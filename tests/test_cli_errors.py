"""The real `crossdc` console script on bad inputs: one line on stderr, non-zero exit, no traceback, nothing left running.

The bad `crossdc run` invocations each import torch (~3 s of CPU), so they are
started together once per module and the tests check their results.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import CROSSDC  # tests/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC_EXAMPLE = REPO / "examples" / "synthetic-2dc.toml"
CLI_TIMEOUT_S = 120
FLOWER_PROCESS_MARKERS = ("flower-superlink", "flower-supernode", "crossdc.clients.supernode", "flower-superexec", "flwr-serverapp",
                          "flwr-clientapp", "crossdc.clients.trainer")




@dataclass
class Result:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    folder: Path


def cli(args: list[str], folder: Path, extra_env: dict[str, str] | None = None, timeout_s: float = CLI_TIMEOUT_S) -> Result:
    """Run `crossdc ARGS` in `folder` (so nothing lands in the checkout), with a private default database (and
    `extra_env` on top of this process's environment)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(CROSSDC_DATABASE_URL=f"sqlite:///{folder / 'env-default.db'}", FLWR_TELEMETRY_ENABLED="0",
               FLWR_DISABLE_UPDATE_CHECK="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    completed = subprocess.run([CROSSDC, *args], cwd=folder, env=env, capture_output=True, text=True,
                               timeout=timeout_s, stdin=subprocess.DEVNULL)
    return Result(args, completed.returncode, completed.stdout, completed.stderr, folder)


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes (not this one) whose command line or environment contains `text`."""
    needle = text.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                environ = b""
            status = (entry / "status").read_text()
        except OSError:
            continue
        if "State:\tZ" in status:
            continue
        if needle in cmdline or needle in environ:
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def flower_like_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(marker in cmdline for marker in FLOWER_PROCESS_MARKERS):
            pids.add(int(entry.name))
    return pids


def assert_one_error_line(result: Result, *fragments: str) -> str:
    everything = result.stdout + result.stderr
    assert "Traceback" not in everything, everything
    assert result.returncode != 0, everything
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"stderr is not one line: {result.stderr!r}"
    line = lines[0]
    assert line.startswith("crossdc: error:") and line[len("crossdc: error:"):].strip(), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    assert result.stdout.strip() == "", result.stdout
    return line


def assert_nothing_left_running(folder: Path) -> None:
    left = processes_mentioning(str(folder))
    assert not left, f"processes left running: {left}"


# -- bad configs and options for `crossdc run`, run together ---------------------------------

BASE = """\
[run]
name = "cli-test"
rounds = 2
seed = 0

[workload]
dataset = "synthetic"
model = "linear"
partition = { kind = "iid" }
batch_size = 16
optimizer = "sgd"
lr = 0.1

[strategy]
name = "fedavg"
tau = 1

[[datacenters]]
name = "us-east"

[[datacenters]]
name = "eu-west"
"""

# case → (config text, or None for examples/synthetic-2dc.toml; extra args; fragments the error line must contain)
CASES: dict[str, tuple[str | None, list[str], tuple[str, ...]]] = {
    "missing-key": (BASE.replace("rounds = 2\n", ""), [], ("missing key 'run.rounds'",)),
    "unknown-key": (BASE + "\n[experiment]\nx = 1\n", [], ("unknown key 'experiment'",)),
    "misspelt-key": (BASE.replace("batch_size = 16", "batchsize = 16"), [], ("'workload.batchsize'", "did you mean 'batch_size'")),
    "unknown-dataset": (BASE.replace('dataset = "synthetic"', 'dataset = "cifar"'), [],
                        ("unknown dataset 'cifar'", "digits", "mnist1d", "shakespeare", "synthetic")),
    "unknown-strategy": (BASE.replace('name = "fedavg"', 'name = "fedprocs"'), [],
                         ("unknown strategy 'fedprocs'", "diloco", "fedavg", "fedprox", "scaffold")),
    "tau-zero": (BASE.replace("tau = 1", "tau = 0"), [], ("'strategy.tau'", "> 0")),
    "strategy-param-type": (BASE.replace('name = "fedavg"\ntau = 1', 'name = "fedprox"\ntau = 1\nparams = { mu = "big" }'), [],
                            ("strategy 'fedprox' parameter 'mu' must be float", "'big'")),
    "strategy-param-range": (BASE.replace('name = "fedavg"\ntau = 1', 'name = "diloco"\ntau = 1\nparams = { outer_momentum = 1.5 }'), [],
                             ("strategy 'diloco' parameter 'outer_momentum' must be ≤ 0.999", "1.5")),
    "strategy-param-unknown": (BASE.replace('name = "fedavg"\ntau = 1', 'name = "scaffold"\ntau = 1\nparams = { eta = 1 }'), [],
                               ("unknown parameter 'eta' for strategy 'scaffold'", "global_lr")),
    "strategy-optimizer": (BASE.replace('name = "fedavg"\ntau = 1', 'name = "diloco"\ntau = 1'), [],
                           ("strategy 'diloco' needs workload.optimizer = \"adamw\"", "\"sgd\"")),
    "zero-datacenters": (BASE.split("[[datacenters]]")[0], [], ("no datacenters",)),
    "invalid-toml": (BASE.replace("[run]", "[run"), [], ("not valid TOML",)),
    "not-implemented": (BASE.replace('name = "fedavg"', 'name = "fedasync"') + '\n[security]\nnorm_rejection_factor = 3\n', [],
                        ("'security.norm_rejection_factor'", "not implemented yet", "fedasync")),
    "streaming-alpha": (BASE.replace('name = "fedavg"\ntau = 1',
                                     'name = "streaming-diloco"\ntau = 4\nparams = { overlap = 2, alpha = 0.0 }')
                        .replace('optimizer = "sgd"', 'optimizer = "adamw"'), [],
                        ("strategy 'streaming-diloco'", "overlap = H/P = 2 with alpha = 0 discards every inner step")),
    "streaming-overlap": (BASE.replace('name = "fedavg"\ntau = 1', 'name = "streaming-diloco"\ntau = 4\nparams = { overlap = 3 }')
                          .replace('optimizer = "sgd"', 'optimizer = "adamw"'), [],
                          ("strategy 'streaming-diloco'", "overlap 3 must be within [0, H/P = 2]")),
    "gossip-ring-of-two": (BASE.replace('name = "fedavg"\ntau = 1', 'name = "gossip"\ntau = 2\nparams = { topology = "ring" }'),
                           [], ("strategy 'gossip'", "a ring needs at least 3 datacenters, the run has 2")),
    "gossip-not-built": (BASE.replace('name = "fedavg"', 'name = "gossip"'), ["--engine", "simulation"],
                         ("strategy 'gossip' (gossip) runs on a local deployment only so far", "not implemented yet")),
    "bad-checkpoint": (BASE + '\n[checkpoint]\nevery_rounds = -1\n', [], ("'checkpoint.every_rounds'", "≥ 0")),
    "unknown-codec": (BASE + '\n[compression]\ncodecs = ["zip"]\n', [], ("'compression.codecs'", "unknown codec 'zip'", "topk")),
    "codec-fraction": (BASE + '\n[compression]\ncodecs = ["topk:1.5"]\n', [], ("codec 'topk' parameter 'fraction'", "1.5")),
    "file-not-found": (None, ["@missing"], ("config file not found",)),
    "unknown-baseline": (None, ["--baseline", "fastest"], ("unknown baseline 'fastest'", "all-workers", "sequential")),
    "detach-without-superlink": (None, ["--detach"], ("--detach needs --superlink",)),
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    root = tmp_path_factory.mktemp("cli-bad-runs")

    def one(case: str) -> Result:
        text, extra, _ = CASES[case]
        folder = root / case
        folder.mkdir()
        if text is None:
            config = SYNTHETIC_EXAMPLE
        else:
            config = folder / "config.toml"
            config.write_text(text)
        if extra[:1] == ["@missing"]:
            config, extra = folder / "does-not-exist.toml", extra[1:]
        args = ["run", str(config), "--db", f"sqlite:///{folder / 'x.db'}", "--runs-dir", str(folder / "runs"), *extra]
        return cli(args, folder)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(CASES, pool.map(one, CASES), strict=False))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_run_is_one_line_and_starts_nothing(bad_runs: dict[str, Result], case: str) -> None:
    result = bad_runs[case]
    assert_one_error_line(result, *CASES[case][2])
    assert_nothing_left_running(result.folder)
    # it failed before anything started: no run folder, no database
    assert not (result.folder / "runs").exists()
    assert not (result.folder / "x.db").exists()


def test_config_path_in_the_not_found_message(bad_runs: dict[str, Result]) -> None:
    line = bad_runs["file-not-found"].stderr.strip()
    assert "does-not-exist.toml" in line


# -- a busy port ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_port_in_use_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    before = flower_like_pids()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = cli(["run", str(SYNTHETIC_EXAMPLE), "--port", str(port), "--db", f"sqlite:///{tmp_path / 'x.db'}",
                      "--runs-dir", str(tmp_path / "runs")], tmp_path)
        line = assert_one_error_line(result, str(port), "in use")
        assert "127.0.0.1" in line
    assert_nothing_left_running(tmp_path)
    started = flower_like_pids() - before
    mine = [pid for pid, _ in processes_mentioning(str(tmp_path)) if pid in started]
    assert not mine, f"Flower/trainer processes left by the run: {mine}"
    # no trainer, SuperLink or SuperNode got as far as writing a run folder
    assert not any((tmp_path / "runs").glob("*/logs/*.log"))


# -- a standing federation admits what the API admits ----------------------------------------------


@pytest.mark.timeout(180)
def test_superlink_runs_and_serve_refuse_what_the_api_refuses(tmp_path: Path) -> None:
    """`crossdc run --superlink` refuses, in one line and before anything starts, what POST /api/runs refuses: a
    checkpoint.dir outside its --checkpoint-root, a datacenter not enrolled and active; `crossdc serve` refuses a
    checkpoint root it cannot confine to."""
    from crossdc.db.engine import make_engine, upgrade
    from crossdc.db.models import DATACENTERS
    from crossdc.db.queries import utcnow

    db_url = f"sqlite:///{tmp_path / 'fed.db'}"
    upgrade(db_url)
    with make_engine(db_url).begin() as conn:  # us-east enrolled and active, eu-west revoked
        conn.execute(sa.insert(DATACENTERS).values(name="us-east", status="active", enrolled_at=utcnow(), node_id="1"))
        conn.execute(sa.insert(DATACENTERS).values(name="eu-west", status="revoked", enrolled_at=utcnow()))
    outside, root = tmp_path / "elsewhere", tmp_path / "ckpt-root"
    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text(SYNTHETIC_EXAMPLE.read_text() + f'\n[checkpoint]\nevery_rounds = 1\ndir = "{outside}"\n')
    submit = ["--superlink", "127.0.0.1:9", "--db", db_url, "--runs-dir", str(tmp_path / "runs"), "--detach"]
    invocations = {
        "checkpoint": (["run", str(elsewhere), *submit, "--checkpoint-root", str(root)], tmp_path / "a"),
        "datacenter": (["run", str(SYNTHETIC_EXAMPLE), *submit], tmp_path / "b"),
        "serve": (["serve", "--port", "1", "--superlink", "127.0.0.1:9", "--checkpoint-root", "s3://bucket/../x"], tmp_path / "c"),
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(invocations, pool.map(lambda item: cli(*item), invocations.values()), strict=True))
    assert_one_error_line(results["checkpoint"], f"'checkpoint.dir' = '{outside}' is outside every checkpoint root",
                          f"checkpoint roots: {root.resolve()}")
    assert_one_error_line(results["datacenter"], "datacenters not enrolled and active at this federation: eu-west (revoked);")
    assert_one_error_line(results["serve"], "--checkpoint-root 's3://bucket/../x'")
    assert not outside.exists() and not (tmp_path / "runs").exists()
    with make_engine(db_url).connect() as conn:
        assert conn.execute(sa.text("select count(*) from runs")).scalar_one() == 0


# -- other commands ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_strategies_list_json(tmp_path: Path) -> None:
    result = cli(["strategies", "list", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert isinstance(rows, list)
    fedavg = next(row for row in rows if row["name"] == "fedavg")
    assert fedavg["source"] == "built-in"
    assert fedavg["parameters"] == {}
    by_name = {row["name"]: row for row in rows}
    assert {"fedprox", "scaffold", "diloco"} <= set(by_name)
    assert all(by_name[n]["source"] == "built-in" for n in ("fedprox", "scaffold", "diloco"))
    assert by_name["fedprox"]["parameters"]["mu"] == {"type": "float", "default": 0.01, "low": 0.0, "high": None,
                                                      "choices": None, "help": by_name["fedprox"]["parameters"]["mu"]["help"]}
    assert by_name["diloco"]["parameters"]["outer_momentum"]["default"] == 0.9
    assert by_name["scaffold"]["parameters"]["global_lr"]["default"] == 1.0
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_codecs_list_json(tmp_path: Path) -> None:
    result = cli(["codecs", "list", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    by_name = {row["name"]: row for row in rows}
    assert {"topk", "int8", "qsgd", "powersgd"} <= set(by_name)
    assert all(by_name[n]["source"] == "built-in" for n in ("topk", "int8", "qsgd", "powersgd"))
    assert by_name["topk"]["stage"] == "structure" and by_name["topk"]["positional"] == "fraction"
    assert by_name["topk"]["parameters"]["fraction"]["default"] == 0.01 and by_name["int8"]["stage"] == "values"


@pytest.mark.timeout(60)
def test_db_upgrade_sqlite_creates_the_tables(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    result = cli(["db", "upgrade", "--db", f"sqlite:///{db}"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "revision" in result.stdout
    engine = sa.create_engine(f"sqlite:///{db}")
    try:
        tables = set(sa.inspect(engine).get_table_names())
        with engine.connect() as conn:
            revision = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one()
    finally:
        engine.dispose()
    assert {"runs", "rounds", "datacenter_rounds", "async_updates", "events", "datacenters", "checkpoints",
            "alembic_version"} <= tables
    assert revision in result.stdout
    # idempotent
    again = cli(["db", "upgrade", "--db", f"sqlite:///{db}"], tmp_path)
    assert again.returncode == 0, again.stderr


@pytest.mark.timeout(60)
def test_db_upgrade_unreachable_postgres_is_one_line(tmp_path: Path) -> None:
    result = cli(["db", "upgrade", "--db", "postgresql://nobody@127.0.0.1:1/x"], tmp_path)
    assert_one_error_line(result, "127.0.0.1", "unavailable")


@pytest.mark.timeout(60)
def test_resume_of_an_unknown_run_is_one_line(tmp_path: Path) -> None:
    assert_one_error_line(cli(["resume", "abc", "--db", f"sqlite:///{tmp_path / 'r.db'}"], tmp_path), "run 'abc' is not in")


def test_every_user_error_the_cli_names_exists() -> None:
    """The CLI looks its user errors up by module and name (so that a bad config fails without importing torch): a
    renamed or moved class would silently turn its one-line message into an internal error."""
    import importlib

    from crossdc.cli import USER_ERRORS, _user_errors

    for module, names in USER_ERRORS.items():
        loaded = importlib.import_module(module)
        for name in names:
            assert issubclass(getattr(loaded, name), Exception), (module, name)
    assert len(_user_errors()) == sum(len(names) for names in USER_ERRORS.values())

"""The `crossdc` command line (an interface scripts rely on: extend it, never break it).

Every user error — a bad config, an unknown strategy or dataset, a busy port,
an unreachable database — ends in one line on stderr and a non-zero exit code,
with no traceback and nothing left running.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any, NoReturn

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="crossdc: train one model across datacenters over a slow WAN.")
db_app = typer.Typer(no_args_is_help=True, help="Database schema (Alembic).")
strategies_app = typer.Typer(no_args_is_help=True, help="Registered strategies (built-in and plug-in).")
codecs_app = typer.Typer(no_args_is_help=True, help="Registered update codecs (built-in and plug-in).")
app.add_typer(db_app, name="db")
app.add_typer(strategies_app, name="strategies")
app.add_typer(codecs_app, name="codecs")
runs_app = typer.Typer(no_args_is_help=True, help="Runs in the run log.")
node_app = typer.Typer(no_args_is_help=True, help="A datacenter's node in a standing federation.")
app.add_typer(runs_app, name="runs")
app.add_typer(node_app, name="node")
admin_app = typer.Typer(no_args_is_help=True, help="Operator tasks: API tokens (stored hashed; use and refusals go to the audit log).")
app.add_typer(admin_app, name="admin")

DB_OPTION = typer.Option(None, "--db", help="Database URL (else $CROSSDC_DATABASE_URL, else sqlite:///crossdc.db).")
DEMO_CONFIG = Path(__file__).parent / "orchestration" / "demo.toml"


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"crossdc: error: {message}", err=True)
    raise typer.Exit(code)


#: the exceptions that are the user's to fix (one line, exit 2), by module: only those of modules already imported
#: are looked up, since an error class can only have been raised once its module is loaded (a bad config then fails
#: without importing torch and Flower just to name their errors)
USER_ERRORS: dict[str, tuple[str, ...]] = {
    "crossdc.experiment.config": ("ConfigError",),
    "crossdc.strategies.base": ("StrategyError",),
    "crossdc.workloads.errors": ("WorkloadError",),
    "crossdc.experiment.processes": ("PortInUse",),
    "crossdc.orchestration.local_run": ("RunFailed",),
    "crossdc.db.errors": ("DatabaseUnavailable", "InvalidDatabaseUrl"),
    "crossdc.clients.channel": ("TrainerFailed", "TrainerUnavailable"),
    "crossdc.deployment.tls": ("CertificateError",),
    "crossdc.clients.node_runner": ("NodeFailed",),
    "crossdc.db.security": ("TokenError",),
    "crossdc.clients.enroll": ("EnrollmentError",),
    "crossdc.deployment.superlink_control": ("ControlError",),
    "crossdc.orchestration.submission": ("SubmissionRefused",),
}


def _user_errors() -> tuple[type[BaseException], ...]:
    return tuple(getattr(sys.modules[module], name) for module, names in USER_ERRORS.items()
                 if module in sys.modules for name in names)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _load_and_check(config_path: Path) -> Any:
    """Parse the config and build what it names now, so a bad name fails before anything starts."""
    from crossdc.experiment.config import load_config

    config = load_config(config_path)
    from crossdc.experiment.builders import check_config

    return check_config(config)


def _print_round(rows: list[dict[str, Any]], total: int) -> None:
    row = rows[-1]
    loss = "   -   " if row.get("val_loss") is None else f"{row['val_loss']:.4f}"
    acc = "  -  " if row.get("val_accuracy") is None else f"{100 * row['val_accuracy']:.1f}%"
    wall = "-" if row.get("wall_s") is None else f"{row['wall_s']:.1f}s"
    tau = "-" if row.get("tau") is None else str(row["tau"])
    typer.echo(f"  round {row['round']:>3}/{total}  tau={tau:<4} val_loss={loss}  val_acc={acc}  "
               f"up={(row.get('bytes_up') or 0) / 1e6:.2f} MB  down={(row.get('bytes_down') or 0) / 1e6:.2f} MB  {wall}",
               err=True)


def _run_experiment(config: Any, db_url: str, engine: str, port: int, runs_dir: Path, quiet: bool,
                    superlink: str | None = None, detach: bool = False, superlink_ca: Path | None = None,
                    run_id: str | None = None, resume: bool = False) -> dict[str, Any]:
    from crossdc.db.security import local_operator
    from crossdc.orchestration.local_run import Detached, LocalRunOptions, run_local

    total = config.run.rounds
    progress = None if quiet else (lambda rows: _print_round(rows, total))
    try:
        result = run_local(config, LocalRunOptions(db_url=db_url, engine=engine, superlink_port=port, runs_root=runs_dir,
                                                   progress=progress, superlink=superlink, detach=detach,
                                                   superlink_ca=superlink_ca, run_id=run_id, resume=resume,
                                                   audited_as=local_operator() if superlink is not None else None))
    except Detached as detached:
        typer.echo(f"crossdc: {detached}", err=True)
        raise typer.Exit(0) from None
    return result.summary


def _checkpoint_roots(given: list[str] | None, runs_dir: Path) -> tuple[str, ...]:
    """The checkpoint roots of --checkpoint-root (default: `runs_dir`), or a one-line failure for a bad one."""
    from crossdc.orchestration.submission import resolve_checkpoint_roots

    try:
        return resolve_checkpoint_roots(given or [], runs_dir.resolve())
    except ValueError as err:
        fail(str(err))


def _install_sigterm() -> None:
    """SIGTERM and SIGHUP (a closed terminal) stop a run like Ctrl-C: cleanly, every process with it."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


def _guard(func: Any) -> Any:
    """Turn user errors into one-line messages and Ctrl-C into exit 130."""
    import functools

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _install_sigterm()
        try:
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            typer.echo("crossdc: interrupted; every process it started was stopped", err=True)
            raise typer.Exit(130) from None
        except _user_errors() as err:
            fail(_one_line(err))
        except Exception as err:  # an internal error: one line here, the traceback on request
            if os.environ.get("CROSSDC_DEBUG"):
                raise
            fail(f"internal error: {type(err).__name__}: {_one_line(err)} (set CROSSDC_DEBUG=1 for the traceback)", code=1)

    return wrapper


@app.command()
@_guard
def run(
    config_path: Path = typer.Argument(..., metavar="CONFIG.toml", help="Experiment config (see examples/)."),
    db: str | None = DB_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the run's summary as a JSON object on the last line."),
    baseline: str | None = typer.Option(None, "--baseline",
                                        help="Instead of the federation, run a baseline: all-workers or sequential (one "
                                             "datacenter), or sync-dp (synchronous data parallel across the emulated WAN)."),
    superlink: str | None = typer.Option(None, "--superlink",
                                         help="HOST:PORT of a standing federation's SuperLink (its private Control API): submit there; "
                                              "Ctrl-C detaches."),
    superlink_ca: Path | None = typer.Option(None, "--superlink-ca",
                                             help="With --superlink: the CA of the SuperLink's certificate (when it serves TLS)."),
    detach: bool = typer.Option(False, "--detach",
                                help="With --superlink: print the run id and return; follow later with `crossdc runs follow`."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port of the local SuperLink."),
    engine: str = typer.Option("deployment", "--engine",
                               help="deployment (SuperLink + SuperNodes) or simulation (Flower's in-process engine)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where run folders (logs, trainer state) go."),
    checkpoint_roots: list[str] | None = typer.Option(None, "--checkpoint-root", metavar="PATH_OR_URL",
                                                      help="With --superlink: where checkpoint.dir may point (repeatable; "
                                                           "a relative one goes under the first; default: --runs-dir)."),
) -> None:
    """Run one experiment locally; prints the run id."""
    if detach and superlink is None:
        fail("--detach needs --superlink (a local run stops with this command)")
    if superlink_ca is not None and (superlink is None or not superlink_ca.is_file()):
        fail("--superlink-ca needs --superlink and an existing CA file")
    if superlink is not None and baseline is not None:
        fail("--baseline runs in this process; it does not take --superlink")
    if checkpoint_roots and superlink is None:
        fail("--checkpoint-root needs --superlink (a local run keeps checkpoints where its config says)")
    if engine not in ("deployment", "simulation"):
        fail(f"unknown engine '{engine}'; known: deployment, simulation")
    config = _load_and_check(config_path)
    from crossdc.db.engine import resolve_database_url, upgrade
    from crossdc.orchestration.baselines import BASELINE_KINDS, gap_to, matching_baselines, run_baseline

    if baseline is not None and baseline not in BASELINE_KINDS:
        fail(f"unknown baseline '{baseline}'; known: {', '.join(BASELINE_KINDS)}")
    db_url = resolve_database_url(db)
    if superlink is not None:  # as POST /api/runs admits it: checkpoints under the roots, enrolled datacenters only
        from crossdc.orchestration.submission import StandingFederation, datacenter_states_at

        roots = _checkpoint_roots(checkpoint_roots, runs_dir)
        upgrade(db_url)
        config = StandingFederation(superlink, superlink_ca, runs_dir.resolve(), roots).admit(config,
                                                                                             datacenter_states_at(db_url))
    if baseline is not None:
        upgrade(db_url)
        run_id = uuid.uuid4().hex
        typer.echo(f"run {run_id}: {baseline} baseline of {config.run.name}", err=True)
        summary = run_baseline(config, baseline, db_url, run_id,
                               progress=None if as_json else (lambda rows: _print_round(rows, config.run.rounds)),
                               runs_root=runs_dir)
    else:
        summary = _run_experiment(config, db_url, engine, port, runs_dir, quiet=as_json, superlink=superlink, detach=detach,
                                  superlink_ca=superlink_ca)
        if summary.get("detached"):
            typer.echo(f"run {summary['run_id']} submitted to {superlink}; follow it with: crossdc runs follow "
                       f"{summary['run_id']}", err=True)
            typer.echo(json.dumps(_jsonable(summary)) if as_json else summary["run_id"])
            return
        typer.echo(f"run {summary['run_id']} finished", err=True)
        # the gap to training in one place, for every baseline of this exact experiment already run
        try:
            summary["gaps"] = {kind: gap_to(base, summary) for kind, base in matching_baselines(db_url, config).items()}
        except Exception as err:  # the run itself is done and logged; a failed look-up must not hide it
            typer.echo(f"crossdc: warning: could not compare with baselines: {_one_line(err)}", err=True)
            summary["gaps"] = {}
        for kind, gap in summary["gaps"].items():
            typer.echo(f"gap to the {kind} baseline: validation loss {100 * gap['val_loss_gap_rel']:+.2f}%, "
                       f"accuracy {gap['val_accuracy_gap_points']:+.1f} points", err=True)
    if as_json:
        typer.echo(json.dumps(_jsonable(summary)))
    else:
        typer.echo(summary["run_id"])


def _jsonable(value: Any) -> Any:
    """``value`` as ``json.dumps`` takes it: NaN/±Inf as ``null`` at any depth (JSON has no such numbers),
    datetimes as ISO 8601 text (the token list)."""
    from datetime import datetime

    from crossdc.db.values import json_safe

    def iso(obj: Any) -> str:
        if isinstance(obj, datetime):
            return obj.isoformat()
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")

    return json_safe(json.loads(json.dumps(value, default=iso)))


@app.command()
@_guard
def demo(
    quick: bool = typer.Option(False, "--quick", help="2 rounds (a smoke test)."),
    db: str | None = DB_OPTION,
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port of the local SuperLink."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir"),
    dashboard_port: int = typer.Option(8080, "--dashboard-port", min=1, max=65535, help="Port of the dashboard (127.0.0.1)."),
    keep_serving: bool | None = typer.Option(None, "--keep-serving/--no-keep-serving",
                                             help="Keep the dashboard up after the table (default: when run in a terminal)."),
) -> None:
    """4 datacenters, naturally non-IID Shakespeare, over emulated transoceanic links; then both single-datacenter
    baselines and a comparison table. The dashboard's URL is printed at the start."""
    from crossdc.dashboard.app import create_app
    from crossdc.orchestration.demo import run_demo

    stay = sys.stdin.isatty() and sys.stdout.isatty() if keep_serving is None else keep_serving
    run_demo(DEMO_CONFIG, quick=quick, db=db, port=port, runs_dir=runs_dir, dashboard_port=dashboard_port, keep_serving=stay,
             dashboard=create_app)


@app.command()
@_guard
def resume(
    run_id: str = typer.Argument(..., help="The run to continue (its id, as `crossdc run` printed it)."),
    db: str | None = DB_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the run's summary as a JSON object on the last line."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port of the local SuperLink."),
    engine: str = typer.Option("deployment", "--engine", help="deployment or simulation (as the run used)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Where the run's folder is (its settings and the datacenters' state)."),
    detach: bool = typer.Option(False, "--detach",
                                help="A run on a standing federation: return once it is resubmitted; follow with `crossdc runs follow`."),
) -> None:
    """Continue a run whose coordinator died (or that was stopped) from its newest checkpoint, under the same run id; a
    run on a standing federation is resubmitted to the SuperLink it ran on, its datacenters' nodes carry on."""
    from crossdc.db.engine import resolve_database_url, safe_url, upgrade
    from crossdc.db.queries import get_run_at
    from crossdc.experiment.config import parse_config
    from crossdc.experiment.rundir import SETTINGS_SUPERLINK, SETTINGS_SUPERLINK_CA, RunDir
    from crossdc.orchestration.local_run import coordinator_alive

    if engine not in ("deployment", "simulation"):
        fail(f"unknown engine '{engine}'; known: deployment, simulation")
    db_url = resolve_database_url(db)
    upgrade(db_url)
    run = get_run_at(db_url, run_id)
    if run is None:
        fail(f"run '{run_id}' is not in {safe_url(db_url)}")
    if run["status"] == "finished":
        fail(f"run '{run_id}' finished; there is nothing to resume")
    run_dir = RunDir(runs_dir.resolve() / run_id)
    if not run_dir.settings_file.is_file():
        fail(f"the run's folder {run_dir.path} is not here (resume on the machine that ran it, with its --runs-dir)")
    if (pid := coordinator_alive(run_dir)) is not None:
        fail(f"run '{run_id}' is still running (its coordinator, pid {pid}, is alive); stop it before resuming")
    settings = run_dir.settings()
    config = parse_config(settings["config"])
    if config.checkpoint.every_rounds <= 0 or not settings.get("checkpoint_url"):
        fail(f"run '{run_id}' took no checkpoints ([checkpoint] every_rounds = 0): nothing to resume from")
    from crossdc.experiment.builders import check_config

    check_config(config)
    superlink: str | None = settings.get(SETTINGS_SUPERLINK)
    superlink_ca = Path(settings[SETTINGS_SUPERLINK_CA]) if settings.get(SETTINGS_SUPERLINK_CA) else None
    if detach and superlink is None:
        fail("--detach resumes a run on a standing federation only (this run ran on this machine)")
    if superlink is not None:
        from crossdc.orchestration.submission import StandingFederation

        federation = StandingFederation(superlink, superlink_ca, runs_dir.resolve())
        if (status := federation.unfinished_status(run)) is not None:
            fail(f"run '{run_id}' is still {status} on the SuperLink {superlink}; stop it before resuming "
                 f"(POST /api/runs/{run_id}/stop)")
    where = f" on the SuperLink {superlink}" if superlink else ""
    typer.echo(f"run {run_id}: resuming {config.run.name} from its newest checkpoint{where}", err=True)
    summary = _run_experiment(config, db_url, engine, port, runs_dir, quiet=as_json, run_id=run_id, resume=True,
                              superlink=superlink, superlink_ca=superlink_ca, detach=detach)
    if summary.get("detached"):
        typer.echo(f"run {run_id} resubmitted to {superlink}; follow it with: crossdc runs follow {run_id}", err=True)
    else:
        typer.echo(f"run {summary['run_id']} finished", err=True)
    typer.echo(json.dumps(_jsonable(summary)) if as_json else summary["run_id"])


@app.command()
@_guard
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, help="Port to listen on (Flower's SuperLink has 8000)."),
    db: str | None = DB_OPTION,
    certfile: Path | None = typer.Option(None, "--certfile", help="Serve HTTPS with this certificate (e.g. from `crossdc certs`)."),
    keyfile: Path | None = typer.Option(None, "--keyfile", help="The certificate's private key."),
    lock_reads: bool = typer.Option(False, "--lock-reads", help="Reads need a token too (any role); default: open reads."),
    superlink_control: str | None = typer.Option(None, "--superlink-control",
                                                 help="HOST:PORT of the SuperLink's private address: enrollments register datacenter "
                                                      "keys there."),
    superlink_ca: Path | None = typer.Option(None, "--superlink-ca",
                                             help="CA of the SuperLink's certificate (it serves TLS when SuperNodes authenticate)."),
    superlink: str | None = typer.Option(None, "--superlink",
                                         help="HOST:PORT of a standing federation's SuperLink (its private Control API): "
                                              "POST /api/runs submits runs there (and enrollments register keys there unless "
                                              "--superlink-control names another address)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="With --superlink: where submitted runs' folders go."),
    checkpoint_roots: list[str] | None = typer.Option(None, "--checkpoint-root", metavar="PATH_OR_URL",
                                                      help="With --superlink: a folder or fsspec URL submitted runs may keep "
                                                           "checkpoints under (repeatable; a relative checkpoint.dir goes under "
                                                           "the first; default: --runs-dir); any other is refused (422)."),
) -> None:
    """The JSON API (/api, OpenAPI at /docs), Prometheus /metrics and the dashboard over the run log; enrollment,
    run submission and admin endpoints need a token (`crossdc admin create-token`)."""
    import uvicorn

    from crossdc.dashboard.app import create_app
    from crossdc.db.engine import absolute_database_url, resolve_database_url, safe_url
    from crossdc.deployment.superlink_control import SuperLinkControl
    from crossdc.experiment.processes import ensure_port_free
    from crossdc.orchestration.submission import StandingFederation

    if (certfile is None) != (keyfile is None):
        fail("give both --certfile and --keyfile, or neither")
    url = absolute_database_url(resolve_database_url(db))
    ensure_port_free(host, port)
    if superlink_ca is not None and not superlink_ca.is_file():
        fail(f"--superlink-ca {superlink_ca}: no such file")
    registers_at = superlink_control or superlink
    control = (SuperLinkControl(registers_at, superlink_ca, insecure=superlink_ca is None)
               if registers_at is not None else None)
    if checkpoint_roots and superlink is None:
        fail("--checkpoint-root needs --superlink (only submitted runs are confined to it)")
    federation = (StandingFederation(superlink, superlink_ca, runs_dir.resolve(), _checkpoint_roots(checkpoint_roots, runs_dir))
                  if superlink is not None else None)
    app_ = create_app(url, lock_reads=lock_reads, superlink_control=control, standing_federation=federation)
    scheme = "https" if certfile else "http"
    typer.echo(f"crossdc: serving {safe_url(url)} on {scheme}://{host}:{port}/ (API docs at /docs); reads "
               f"{'need a token' if lock_reads else 'are open'}; enrollment "
               f"{'registers keys at ' + registers_at + ' (again if it loses them)' if control else 'is off (no --superlink-control)'}; "
               "run submission "
               f"{'goes to ' + superlink if federation else 'is off (no --superlink)'}"
               f"{' with checkpoints under ' + ', '.join(federation.roots) if federation else ''}; Ctrl-C stops",
               err=True)
    if scheme == "http" and host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo("crossdc: warning: plain HTTP on a non-loopback address sends tokens in the clear; use --certfile/--keyfile",
                   err=True)
    uvicorn.run(app_, host=host, port=port, log_level="warning", access_log=False,
                ssl_certfile=str(certfile) if certfile else None, ssl_keyfile=str(keyfile) if keyfile else None)


@db_app.command("upgrade")
@_guard
def db_upgrade(db: str | None = DB_OPTION) -> None:
    """Upgrade the database schema to the latest Alembic revision."""
    from crossdc.db.engine import current_revision, resolve_database_url, safe_url, upgrade

    url = resolve_database_url(db)
    upgrade(url)
    typer.echo(f"{safe_url(url)} is at revision {current_revision(url)}")


@strategies_app.command("list")
@_guard
def strategies_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """List registered strategies with their parameters."""
    from crossdc.strategies.registry import describe_strategies

    rows: list[dict[str, Any]] = describe_strategies()  # type: ignore[assignment]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    width = max((len(str(row["name"])) for row in rows), default=0)
    for row in rows:
        params = ", ".join(f"{k}={v['default']}" for k, v in row["parameters"].items()) or "no parameters"
        typer.echo(f"{row['name']:<{width}} {row['source']:<9} {row['summary']}  [{params}]")


@codecs_app.command("list")
@_guard
def codecs_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """List registered codecs (entry-point group crossdc.codecs) with their parameters."""
    from crossdc.compression.base import describe_codecs

    rows = describe_codecs()
    if as_json:
        typer.echo(json.dumps(rows))
        return
    width = max((len(str(row["name"])) for row in rows), default=0)
    for row in rows:
        params = ", ".join(f"{k}={v['default']}" for k, v in row["parameters"].items()) or "no parameters"
        typer.echo(f"{row['name']:<{width}} {row['stage']:<9} {row['source']:<9} {row['summary']}  [{params}]")


@app.command()
@_guard
def plan(
    params: float | None = typer.Option(None, "--params", help="Model parameters, e.g. 1e9 (required without --pipeline)."),
    datacenters: int | None = typer.Option(None, "--datacenters", help="Number of datacenters N (required without --pipeline)."),
    step_time: float = typer.Option(..., "--step-time",
                                    help="Seconds per local optimizer step (one datacenter, all its GPUs; with --pipeline: the "
                                         "whole model's forward and backward of the whole batch on one datacenter)."),
    tau: int | None = typer.Option(None, "--tau",
                                   help="Local steps per round (required without --pipeline; with it DiLoCo's, default 100)."),
    link: str | None = typer.Option(None, "--link", help="Link profile: metro, continental, transoceanic, constrained."),
    bandwidth_mbps: float | None = typer.Option(None, "--bandwidth-mbps", help="Link bandwidth (Mbps); overrides the profile's."),
    rtt_ms: float | None = typer.Option(None, "--rtt-ms", help="Link round-trip time (ms); overrides the profile's."),
    compression: float = typer.Option(1.0, "--compression", help="Uplink compression ratio (raw fp32 bytes / bytes sent)."),
    downlink_compression: float = typer.Option(1.0, "--downlink-compression", help="Downlink compression ratio."),
    round_trips: int | None = typer.Option(None, "--round-trips",
                                           help="Protocol round trips per round (default: Flower 1.42's count for these payloads)."),
    tensors: int = typer.Option(1, "--tensors", help="Tensors per payload (only to count Flower's objects; 1 = fewest)."),
    request_ms: float = typer.Option(0.0, "--request-ms",
                                     help="What the two ends spend on each protocol request besides the link (ms; 0 = links only)."),
    coordinator_bandwidth_mbps: float | None = typer.Option(None, "--coordinator-bandwidth-mbps",
                                                            help="The coordinator's link, shared by the N transfers of each direction."),
    target_ratio: float = typer.Option(0.1, "--target-ratio", help="Comm/comp ratio to reach."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    pipeline: bool = typer.Option(False, "--pipeline",
                                  help="Plan a pipeline split (one stage per datacenter) against data parallel and DiLoCo."),
    stage_params: str | None = typer.Option(None, "--stage-params",
                                            help="--pipeline: parameters per stage, comma-separated, e.g. 5e8,5e8."),
    activation_bytes: float | None = typer.Option(None, "--activation-bytes",
                                                  help="--pipeline: bytes of one micro-batch's activation at a boundary "
                                                       "(its gradient is as large)."),
    microbatches: int | None = typer.Option(None, "--microbatches", help="--pipeline: micro-batches per optimizer step."),
    schedule: str = typer.Option("1f1b", "--schedule", help="--pipeline: gpipe or 1f1b."),
    backward_ratio: float = typer.Option(2.0, "--backward-ratio", help="--pipeline: a backward's time over its forward's."),
    max_params_per_datacenter: float | None = typer.Option(None, "--max-params-per-datacenter",
                                                           help="--pipeline: the most parameters one datacenter holds "
                                                                "(default: no limit)."),
) -> None:
    """The cost model: time per round, comm/comp and utilisation, and the tau or compression that bring comm/comp under a target.
    With --pipeline: a pipeline split's step (its schedule simulated) beside data parallel and DiLoCo, and a verdict."""
    from dataclasses import asdict

    from crossdc.wan import cost_model as cm

    if pipeline:
        if params is not None or datacenters is not None:
            fail("--pipeline takes the model from --stage-params (its stages are the datacenters): drop --params and "
                 "--datacenters")
        _plan_pipeline(stage_params, activation_bytes, microbatches, schedule, step_time, backward_ratio,
                       100 if tau is None else tau, link, bandwidth_mbps, rtt_ms, max_params_per_datacenter, as_json)
        return
    given = [name for name, value in (("--stage-params", stage_params), ("--activation-bytes", activation_bytes),
                                      ("--microbatches", microbatches),
                                      ("--max-params-per-datacenter", max_params_per_datacenter)) if value is not None]
    if given:
        fail(f"{', '.join(given)} plan a pipeline split: add --pipeline")
    missing = [name for name, value in (("--params", params), ("--datacenters", datacenters), ("--tau", tau))
               if value is None]
    if missing or params is None or datacenters is None or tau is None:
        fail(f"missing {', '.join(missing)} (or plan a pipeline split with --pipeline)")
    try:
        spec = cm.resolve_link(link, bandwidth_mbps, rtt_ms)
        star = cm.StarPlan(params=params, datacenters=cm.uniform_datacenters(datacenters, spec), step_time_s=step_time,
                           tau=tau, compression_up=compression, compression_down=downlink_compression,
                           round_trips_per_round=round_trips, tensors=tensors, request_s=request_ms / 1000.0,
                           coordinator_bandwidth_mbps=coordinator_bandwidth_mbps)
        sync = cm.sync_dp_step(params, datacenters, spec, step_time)
        estimate = cm.star_round(star)
        tau_needed = cm.tau_for_ratio(star, target_ratio)
        compression_both = cm.compression_for_ratio(star, target_ratio, "both")
        compression_up = cm.compression_for_ratio(star, target_ratio, "up")
    except cm.CostModelError as err:
        fail(str(err))
    one = estimate.datacenters[0]
    if as_json:
        round_fields = {k: v for k, v in asdict(estimate).items() if k != "datacenters"}
        round_fields.update(transfer_down_s=one.transfer_down_s, transfer_up_s=one.transfer_up_s, latency_s=one.latency_s)
        typer.echo(json.dumps({
            "inputs": {"params": params, "datacenters": datacenters, "link": asdict(spec), "step_time_s": step_time,
                       "tau": tau, "compression_up": compression, "compression_down": downlink_compression,
                       "round_trips_per_round": round_trips, "tensors": tensors, "request_ms": request_ms,
                       "coordinator_bandwidth_mbps": coordinator_bandwidth_mbps, "target_ratio": target_ratio},
            "sync_dp": asdict(sync),
            "sync_dp_tau_steps_s": tau * sync.step_s,
            "crossdc": round_fields,
            "tau_for_target": tau_needed,
            "compression_for_target": compression_both,
            "uplink_compression_for_target": compression_up,
        }))
        return

    typer.echo(f"{params:.3g} parameters ({_size(4 * params)} fp32), {datacenters} datacenters, link {spec.name} "
               f"({spec.bandwidth_mbps:g} Mbps, {spec.rtt_ms:g} ms RTT), step {step_time:g} s, tau {tau}")
    typer.echo(f"{'':<30}{'compute':>10}{'comm':>10}{'comm/comp':>11}{'utilisation':>13}")
    typer.echo(f"{'sync data parallel, per step':<30}{_secs(sync.compute_s):>10}{_secs(sync.comm_s):>10}"
               f"{sync.comm_comp_ratio:>11.3g}{100 * sync.utilisation:>12.1f}%")
    typer.echo(f"{'crossdc, per round':<30}{_secs(estimate.compute_s):>10}{_secs(estimate.comm_s):>10}"
               f"{estimate.comm_comp_ratio:>11.3g}{100 * estimate.utilisation:>12.1f}%")
    typer.echo(f"crossdc round {_secs(estimate.round_s)} = compute {_secs(estimate.compute_s)} + down {_size(estimate.bytes_down)} "
               f"({_secs(one.transfer_down_s)}) + up {_size(estimate.bytes_up)} ({_secs(one.transfer_up_s)}) + "
               + (f"{estimate.round_trips} round trips ({_secs(one.latency_s)})" if round_trips is not None else
                  f"latency {_secs(one.latency_s)} ({estimate.round_trips} round trips if Flower's two requests in flight "
                  f"went in lock-step; they overlap the transfers)"))
    typer.echo(f"the same {tau} steps in sync data parallel: {_secs(tau * sync.step_s)}")
    typer.echo(f"tau for comm/comp <= {target_ratio:g} at this compression: {tau_needed}")
    both = "impossible (latency alone exceeds the target)" if compression_both is None else f"{compression_both:.4g}x"
    up = "impossible (the downlink and latency alone exceed the target)" if compression_up is None else f"{compression_up:.4g}x"
    typer.echo(f"compression for comm/comp <= {target_ratio:g} at tau {tau}: {both} both ways; uplink only: {up}")


def _size(n: float) -> str:
    """A byte count for a table: GB from 1e9 bytes, MB below."""
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def _secs(t: float) -> str:
    """Seconds for a table: whole seconds with separators from 1,000 s, three significant digits below."""
    return f"{t:,.0f} s" if t >= 1000 else f"{t:.3g} s"


def _plan_pipeline(stage_params: str | None, activation_bytes: float | None, microbatches: int | None, schedule: str,
                   step_time: float, backward_ratio: float, tau: int, link: str | None, bandwidth_mbps: float | None,
                   rtt_ms: float | None, max_params_per_datacenter: float | None, as_json: bool) -> None:
    """`crossdc plan --pipeline`: the pipeline split's step against data parallel and DiLoCo (crossdc.wan.pipeline_plan)."""
    from dataclasses import asdict

    from crossdc.wan import cost_model as cm
    from crossdc.wan import pipeline_plan as pp

    missing = [name for name, value in (("--stage-params", stage_params), ("--activation-bytes", activation_bytes),
                                        ("--microbatches", microbatches)) if value is None]
    if missing or stage_params is None or activation_bytes is None or microbatches is None:
        fail(f"--pipeline needs {', '.join(missing)}")
    try:
        counts = [float(part) for part in stage_params.split(",")]
    except ValueError:
        fail(f"--stage-params must be comma-separated numbers (parameters per stage), got {stage_params!r}")
    try:
        spec = cm.resolve_link(link, bandwidth_mbps, rtt_ms)
        split = pp.PipelinePlan(stage_params=counts, activation_bytes=activation_bytes, microbatches=microbatches,
                                step_time_s=step_time, links=pp.uniform_links(len(counts), spec), schedule=schedule,
                                backward_ratio=backward_ratio, max_params_per_datacenter=max_params_per_datacenter)
        result = pp.compare(split, tau)
    except cm.CostModelError as err:
        fail(str(err))
    pipe = result.pipeline
    if as_json:
        typer.echo(json.dumps({
            "inputs": {"stage_params": counts, "activation_bytes": activation_bytes, "microbatches": microbatches,
                       "schedule": schedule, "step_time_s": step_time, "backward_ratio": backward_ratio, "tau": tau,
                       "link": asdict(spec), "max_params_per_datacenter": max_params_per_datacenter},
            "pipeline": {k: v for k, v in asdict(pipe).items() if k != "timeline"},
            "data_parallel": asdict(result.data_parallel),
            "diloco": {k: v for k, v in asdict(result.diloco).items() if k != "datacenters"},
            "strategies": [asdict(cost) for cost in result.costs],
            "activation_to_gradient_ratio": result.activation_to_gradient_ratio,
            "winner": result.winner,
            "verdict": result.verdict,
        }))
        return

    typer.echo(f"pipeline split of {split.total_params:.3g} parameters into {pipe.stages} stages "
               f"({' + '.join(f'{count:.3g}' for count in counts)}), {microbatches} micro-batches of "
               f"{_size(activation_bytes)}, link {spec.name} ({spec.bandwidth_mbps:g} Mbps, {spec.rtt_ms:g} ms RTT) at "
               f"every boundary, step {step_time:g} s on one datacenter")
    typer.echo(f"{'':<22}{'step':>10}{'WAN bytes/step':>16}{'exposed comm':>14}{'params/DC':>11}")
    for cost in result.costs:
        typer.echo(f"{cost.name:<22}{_secs(cost.step_s):>10}{_size(cost.wan_bytes_per_step):>16}"
                   f"{_secs(cost.exposed_comm_s):>14}{cost.params_per_datacenter:>11.3g}"
                   + ("" if cost.feasible else f"  ({cost.note})"))
    typer.echo(f"pipeline: {_secs(pipe.free_links_step_s)} over free links + {_secs(pipe.exposed_comm_s)} the WAN adds; "
               f"stages idle {100 * pipe.bubble_fraction:.1f}% (schedule alone: "
               f"{100 * pipe.theoretical_bubble_fraction:.1f}%); per micro-batch and boundary "
               f"{_secs(pipe.transfer_s[0])} on the wire + {_secs(pipe.latency_s[0])} one way")
    typer.echo(f"data parallel and DiLoCo: {pipe.stages} datacenters with the whole model, each computing 1/{pipe.stages} "
               f"of the batch ({_secs(step_time / pipe.stages)} per step)")
    typer.echo(f"verdict: {result.verdict}")


@app.command()
@_guard
def certs(
    out: Path = typer.Option(Path("certs"), "--out", help="Directory for ca.pem, ca.key, server.pem, server.key."),
    host: list[str] = typer.Option(..., "--host", help="Name or IP address the server certificate is valid for (repeat)."),
    days: int = typer.Option(365, "--days", min=1, help="Validity in days."),
    force: bool = typer.Option(False, "--force", help="Replace existing certificates."),
) -> None:
    """Create a private CA and a server certificate for a test or small deployment (production brings its own)."""
    from crossdc.deployment.tls import make_certificates

    paths = make_certificates(out, host, days=days, force=force)
    typer.echo(f"CA certificate (give it to every datacenter): {paths.ca_cert}")
    typer.echo(f"CA key (keep it offline): {paths.ca_key}")
    typer.echo(f"server certificate and key for {', '.join(host)}: {paths.server_cert}, {paths.server_key}")


@app.command()
@_guard
def front(
    superlink: str = typer.Option("127.0.0.1:9093", "--superlink", help="The SuperLink's private HOST:PORT."),
    listen: str = typer.Option("0.0.0.0:9092", "--listen", help="HOST:PORT datacenters connect to."),
    certfile: Path | None = typer.Option(None, "--certfile", help="TLS certificate (e.g. from `crossdc certs`)."),
    keyfile: Path | None = typer.Option(None, "--keyfile", help="Its private key."),
    insecure: bool = typer.Option(False, "--insecure", help="Serve plain HTTP (loopback tests only)."),
    superlink_ca: Path | None = typer.Option(None, "--superlink-ca",
                                             help="The SuperLink serves TLS signed by this CA (needed with SuperNode authentication)."),
) -> None:
    """Serve the Fleet API of a private SuperLink to datacenters, refusing everything else (Control API included)."""
    import uvicorn

    from crossdc.deployment.fleet_front import FrontStats, front_config
    from crossdc.experiment.processes import ensure_port_free

    if not insecure and (certfile is None or keyfile is None):
        fail("the front serves TLS: give --certfile and --keyfile (make them with `crossdc certs`), or --insecure on loopback")
    host, _, port_text = listen.rpartition(":")
    if not host or not port_text.isdigit():
        fail(f"--listen must be HOST:PORT, got {listen!r}")
    ensure_port_free(host, int(port_text))
    upstream = f"{'https' if superlink_ca else 'http'}://{superlink}"
    config = front_config(upstream, host, int(port_text), None if insecure else certfile,
                          None if insecure else keyfile, FrontStats(), upstream_ca=superlink_ca)
    typer.echo(f"Fleet API front on {'http' if insecure else 'https'}://{listen} → SuperLink {superlink} (Fleet API only)")
    uvicorn.Server(config).run()


@runs_app.command("follow")
@_guard
def runs_follow(run_id: str, db: str | None = DB_OPTION) -> None:
    """Follow a run in the run log until it ends (e.g. one submitted with --superlink --detach)."""
    from crossdc.db.engine import resolve_database_url
    from crossdc.orchestration.follow import follow_run

    summary = follow_run(resolve_database_url(db), run_id, progress=lambda row, planned: _print_round([row], planned))
    typer.echo(f"run {run_id} finished", err=True)
    typer.echo(json.dumps(_jsonable(summary)))


@node_app.command("start")
@_guard
def node_start(
    superlink: str | None = typer.Option(None, "--superlink",
                                         help="HOST:PORT the datacenter reaches the federation at (the Fleet API front; default: the "
                                              "front `crossdc enroll` recorded in STATE_DIR/enrollment.json)."),
    datacenter: str = typer.Option(..., "--datacenter", help="This datacenter's name, as in the experiment configs."),
    state_dir: Path = typer.Option(Path("crossdc-node"), "--state-dir",
                                   help="Durable state: trainers' state stores, logs, the node's key."),
    root_certificates: Path | None = typer.Option(None, "--root-certificates",
                                                  help="CA the front's certificate is signed by (`crossdc certs`' ca.pem)."),
    insecure: bool = typer.Option(False, "--insecure", help="Plain HTTP to the SuperLink (loopback tests only)."),
    max_runs: int = typer.Option(2, "--max-runs", min=1, help="Trainers kept alive at once (least recently used stopped)."),
    auth_key: Path | None = typer.Option(None, "--auth-key",
                                         help="The SuperNode's enrolled private key: OpenSSH, or PEM (PKCS#8 or SEC1, converted), EC on "
                                              "P-256/384/521, unencrypted (default: STATE_DIR/node-key when `crossdc enroll` made one)."),
) -> None:
    """Run this datacenter's side of a standing federation: its SuperNode and the node service that gives every
    run a persistent local trainer (all local GPUs). Ctrl-C stops both."""
    from crossdc.clients.enroll import ENROLLMENT_FILE, PRIVATE_KEY_FILE, supernode_auth_key
    from crossdc.clients.node import node_socket
    from crossdc.clients.node_runner import run_node

    if not insecure and root_certificates is None:
        fail("the SuperNode talks TLS: give --root-certificates (the CA of `crossdc certs`), or --insecure on loopback")
    if root_certificates is not None and not root_certificates.is_file():
        fail(f"--root-certificates: no such file: {root_certificates}")
    state_dir = state_dir.resolve()
    if superlink is None:
        try:
            superlink = str(json.loads((state_dir / ENROLLMENT_FILE).read_text())["front"])
        except (OSError, ValueError, KeyError, TypeError):
            fail(f"give --superlink FRONT_HOST:PORT (no front recorded by `crossdc enroll` in {state_dir / ENROLLMENT_FILE})")
    if auth_key is None and (state_dir / PRIVATE_KEY_FILE).exists():
        auth_key = state_dir / PRIVATE_KEY_FILE
    if auth_key is not None and not auth_key.is_file():
        fail(f"--auth-key: no such file: {auth_key}")
    if auth_key is not None:  # flower-supernode reads only OpenSSH keys: refuse or convert before it starts
        state_dir.mkdir(parents=True, exist_ok=True)
        auth_key = supernode_auth_key(auth_key, state_dir)
    signed = f"signed with {auth_key}" if auth_key else "unauthenticated (no enrolled key)"
    typer.echo(f"datacenter {datacenter}: SuperNode → {superlink} ({signed}), node service on {node_socket(state_dir)}, "
               f"state in {state_dir}", err=True)
    run_node(superlink, datacenter, state_dir, root_certificates, insecure, max_runs, auth_key=auth_key)


@node_app.command("health")
@_guard
def node_health(
    state_dir: Path = typer.Option(Path("crossdc-node"), "--state-dir", help="The node's state folder (as for `node start`)."),
    max_age_s: float = typer.Option(60.0, "--max-age", min=1, help="Seconds since the SuperLink last accepted the SuperNode."),
) -> None:
    """Exit 0 if this datacenter's node is healthy: its node service answers, and the SuperLink accepted its
    SuperNode within --max-age seconds (compose.yaml's health check)."""
    from crossdc.clients.node_runner import node_health as check

    typer.echo(check(state_dir.resolve(), max_age_s))


@app.command()
@_guard
def enroll(
    server: str = typer.Option(..., "--server", help="URL of the federation's crossdc service, e.g. https://ops.example:8443."),
    name: str = typer.Option(..., "--name", help="This datacenter's name, as experiment configs use it."),
    gpus: int = typer.Option(..., "--gpus", min=0, help="GPUs this datacenter trains with."),
    region: str | None = typer.Option(None, "--region", help="Where it is (free text)."),
    bandwidth_mbps: float | None = typer.Option(None, "--bandwidth-mbps", min=0.001, help="WAN bandwidth, if known."),
    rtt_ms: float | None = typer.Option(None, "--rtt-ms", min=0, help="WAN round-trip time, if known."),
    state_dir: Path = typer.Option(Path("crossdc-node"), "--state-dir", help="The node's state folder; the key pair is made here."),
    ca_cert: Path | None = typer.Option(None, "--ca-cert", help="CA of the service's certificate (`crossdc certs`' ca.pem)."),
    front: str | None = typer.Option(None, "--front",
                                     help="HOST:PORT of the federation's Fleet API front, where the node connects (default: the "
                                          "--server's host, port 9092); recorded for `crossdc node start`."),
    new_key: bool = typer.Option(False, "--new-key",
                                 help="Make a new key pair first (to enroll again after a suspension); the old one is kept aside."),
    token_env: str = typer.Option("CROSSDC_ENROLLMENT_TOKEN", "--token-env",
                                  help="Environment variable holding the enrollment token (never a command-line argument: those are "
                                       "visible to every user)."),
) -> None:
    """Enroll this datacenter: make its SuperNode key pair (the private key stays here, mode 0600) and register the
    public key with the federation using the operator's enrollment token. Then: crossdc node start."""
    from crossdc.clients.enroll import PRIVATE_KEY_FILE
    from crossdc.clients.enroll import enroll as enroll_datacenter

    token = os.environ.get(token_env, "").strip()
    if not token:
        fail(f"put the operator's enrollment token in ${token_env}")
    if ca_cert is not None and not ca_cert.is_file():
        fail(f"--ca-cert: no such file: {ca_cert}")
    record = enroll_datacenter(server, token, state_dir.resolve(), name=name, gpus=gpus, region=region,
                               link_bandwidth_mbps=bandwidth_mbps, link_rtt_ms=rtt_ms, ca_cert=ca_cert, new_key=new_key,
                               front=front)
    typer.echo(f"datacenter {name} enrolled (node {record.get('node_id')}); key in {state_dir.resolve() / PRIVATE_KEY_FILE}; "
               f"start it with: crossdc node start --datacenter {name} --state-dir {state_dir} --superlink {record['front']} "
               f"--root-certificates {ca_cert if ca_cert is not None else 'CA.pem'} (its SuperNode connects to the Fleet API "
               f"front {record['front']}; its trainers' heartbeat goes to UDP on that host)", err=True)


@admin_app.command("create-token")
@_guard
def admin_create_token(
    name: str = typer.Option(..., "--name", help="A name for the token (shown in the audit log)."),
    role: str = typer.Option("admin", "--role", help="admin, enrollment (may only enroll datacenters) or read."),
    expires_in: str | None = typer.Option(None, "--expires-in", metavar="DURATION",
                                          help="Refuse the token from this long after now on: e.g. 90d, 12h, 30m "
                                               "(default: it never expires)."),
    db: str | None = DB_OPTION,
) -> None:
    """Create an API token; it is printed once (stdout) and stored only as its SHA-256."""
    from crossdc.db.engine import make_engine, resolve_database_url, upgrade
    from crossdc.db.security import create_token, local_operator, parse_duration

    lifetime = parse_duration(expires_in) if expires_in is not None else None
    url = resolve_database_url(db)
    upgrade(url)
    token = create_token(make_engine(url), name, role, expires_in=lifetime, actor=local_operator())
    until = f", expires in {expires_in}" if expires_in is not None else ""
    typer.echo(f"token '{name}' (role {role}{until}) created; it is shown only now:", err=True)
    typer.echo(token)


@admin_app.command("revoke-token")
@_guard
def admin_revoke_token(name: str = typer.Argument(..., help="The token's name."), db: str | None = DB_OPTION) -> None:
    """Revoke an API token from now on."""
    from crossdc.db.engine import make_engine, resolve_database_url
    from crossdc.db.security import local_operator, revoke_token

    revoke_token(make_engine(resolve_database_url(db)), name, actor=local_operator())
    typer.echo(f"token '{name}' revoked", err=True)


@admin_app.command("tokens")
@_guard
def admin_tokens(db: str | None = DB_OPTION, as_json: bool = typer.Option(False, "--json")) -> None:
    """List API tokens: name, role, dates, expiry (never the tokens)."""
    from crossdc.db.engine import make_engine, resolve_database_url
    from crossdc.db.queries import utcnow
    from crossdc.db.security import list_tokens, token_problem

    rows = list_tokens(make_engine(resolve_database_url(db)))
    if as_json:
        typer.echo(json.dumps(_jsonable(rows)))
        return
    now = utcnow()
    for row in rows:
        problem = token_problem(row["revoked_at"], row["expires_at"], now)
        state = (f"revoked {row['revoked_at']:%Y-%m-%d %H:%M}" if problem == "revoked" else
                 f"expired {row['expires_at']:%Y-%m-%d %H:%M}" if problem == "expired" else
                 f"live, expires {row['expires_at']:%Y-%m-%d %H:%M}" if row["expires_at"] else "live")
        typer.echo(f"{row['name']:<24} {row['role']:<11} created {row['created_at']:%Y-%m-%d %H:%M}  {state}")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())

"""crossdc's Flower ServerApp: a thin adapter from Flower's entry point to the federated loop.

Under the Deployment Engine the run folder arrives in the run config
(``crossdc-run-dir``); under simulation :func:`make_server_app` binds it.
A run on a standing federation (its settings name the SuperLink it was submitted to: ``crossdc run --superlink``,
``POST /api/runs``) has its grid bound to the enrollments in its database
(:func:`crossdc.federation.grid_io.bind_identities`): each node is the datacenter its key was enrolled as. A local
run's nodes are its own processes, taken at their word.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from crossdc.experiment.processes import die_with_run_root
from crossdc.experiment.rundir import SETTINGS_SUPERLINK, RunDir
from crossdc.federation.grid_io import bind_identities
from crossdc.federation.sync_loop import run_federation
from crossdc.protocol import RUN_DIR

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    die_with_run_root()  # a local run's ServerApp dies with `crossdc run`, before it could record an end of its own
    run_dir = str(context.run_config.get(RUN_DIR, ""))
    if not run_dir:
        raise RuntimeError(f"the run config has no '{RUN_DIR}': start runs with `crossdc run`")
    run = RunDir(Path(run_dir))
    settings = run.settings()
    if settings.get(SETTINGS_SUPERLINK):  # a standing federation: its SuperLink authenticates each node by its key
        bind_identities(grid, str(settings["db_url"]))
    run_federation(grid, run)


def make_server_app(run_dir: RunDir) -> ServerApp:
    """A ServerApp bound to one run folder (for Flower's simulation engine)."""
    bound = ServerApp()

    @bound.main()
    def _main(grid: Grid, context: Context) -> None:
        run_federation(grid, run_dir)

    return bound

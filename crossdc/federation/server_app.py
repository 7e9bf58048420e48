"""crossdc's Flower ServerApp: a thin adapter from Flower's entry point to the federated loop.

Under the Deployment Engine the run folder arrives in the run config
(``crossdc-run-dir``); under simulation :func:`make_server_app` binds it.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from crossdc.experiment.rundir import RunDir
from crossdc.federation.sync_loop import run_federation
from crossdc.protocol import RUN_DIR

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_dir = str(context.run_config.get(RUN_DIR, ""))
    if not run_dir:
        raise RuntimeError(f"the run config has no '{RUN_DIR}': start runs with `crossdc run`")
    run_federation(grid, RunDir(Path(run_dir)))


def make_server_app(run_dir: RunDir) -> ServerApp:
    """A ServerApp bound to one run folder (for Flower's simulation engine)."""
    bound = ServerApp()

    @bound.main()
    def _main(grid: Grid, context: Context) -> None:
        run_federation(grid, run_dir)

    return bound

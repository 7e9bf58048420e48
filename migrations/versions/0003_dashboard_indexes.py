"""Indexes for the dashboard's reads: a page of a long run is an index range scan.

* ``rounds (run_id, wall_s)``: a run's slowest round (its effective status) without reading all its rounds;
* ``datacenter_rounds (run_id, datacenter, round)``: one datacenter's rows of a run, by round;
* ``events (run_id, id)``: a run's events in logging order (PostgreSQL's index on ``run_id`` alone does not
  keep that order, so each page sorted all the run's events).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 22:30:00
"""
from typing import Sequence, Union

from alembic import op

revision: str = "0003"
down_revision: Union[str, Sequence[str], None] = "0002"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_index("ix_rounds_run_id_wall_s", "rounds", ["run_id", "wall_s"], unique=False)
    op.create_index("ix_datacenter_rounds_run_id_datacenter_round", "datacenter_rounds",
                    ["run_id", "datacenter", "round"], unique=False)
    op.create_index("ix_events_run_id_id", "events", ["run_id", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_events_run_id_id", table_name="events")
    op.drop_index("ix_datacenter_rounds_run_id_datacenter_round", table_name="datacenter_rounds")
    op.drop_index("ix_rounds_run_id_wall_s", table_name="rounds")

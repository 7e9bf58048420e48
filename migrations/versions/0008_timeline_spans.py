"""Per-datacenter timelines: one row per span of what a trainer did or what was in flight (timeline_spans).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 06:00:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: Union[str, Sequence[str], None] = "0007"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "timeline_spans",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("datacenter", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("start_s", sa.Float(), nullable=False),
        sa.Column("end_s", sa.Float(), nullable=False),
        sa.Column("fragment", sa.Integer(), nullable=True),
        sa.Column("exchange", sa.Integer(), nullable=True),
        sa.CheckConstraint("kind IN ('compute', 'wait', 'up', 'down')", name=op.f("ck_timeline_spans_kind")),
        sa.CheckConstraint("end_s >= start_s", name=op.f("ck_timeline_spans_end_after_start")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_timeline_spans_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_timeline_spans")),
    )
    op.create_index(op.f("ix_timeline_spans_run_id"), "timeline_spans", ["run_id"])
    op.create_index("ix_timeline_spans_run_id_datacenter_start_s", "timeline_spans", ["run_id", "datacenter", "start_s"])


def downgrade() -> None:
    op.drop_index("ix_timeline_spans_run_id_datacenter_start_s", table_name="timeline_spans")
    op.drop_index(op.f("ix_timeline_spans_run_id"), table_name="timeline_spans")
    op.drop_table("timeline_spans")

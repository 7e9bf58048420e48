"""Pipeline runs: each stage's part of each round (pipeline_stages), and micro-batch spans on the timeline
(timeline_spans: kinds forward and backward, columns microbatch and step, an index on (run_id, round)).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 07:00:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: Union[str, Sequence[str], None] = "0009"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

_KINDS_0008 = "kind IN ('compute', 'wait', 'up', 'down')"
_KINDS_0010 = "kind IN ('compute', 'wait', 'up', 'down', 'forward', 'backward')"


def upgrade() -> None:
    op.create_table(
        "pipeline_stages",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("datacenter", sa.String(length=128), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("microbatches", sa.Integer(), nullable=False),
        sa.Column("compute_s", sa.Float(), nullable=False),
        sa.Column("wall_s", sa.Float(), nullable=False),
        sa.Column("bubble_fraction", sa.Float(), nullable=False),
        sa.Column("bytes_forward", sa.BigInteger(), nullable=False),
        sa.Column("bytes_backward", sa.BigInteger(), nullable=False),
        sa.Column("bytes_source", sa.String(length=16), nullable=False),
        sa.Column("train_loss", sa.Float(), nullable=True),
        sa.CheckConstraint("bytes_source IN ('delay-line', 'stage')", name=op.f("ck_pipeline_stages_bytes_source")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_pipeline_stages_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pipeline_stages")),
        sa.UniqueConstraint("run_id", "round", "stage", name=op.f("uq_pipeline_stages_run_id_round_stage")),
    )
    op.create_index(op.f("ix_pipeline_stages_run_id"), "pipeline_stages", ["run_id"])
    # SQLite copies the table (batch mode); PostgreSQL alters it in place. Either way the kind check is replaced.
    with op.batch_alter_table("timeline_spans") as batch:
        batch.add_column(sa.Column("microbatch", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("step", sa.Integer(), nullable=True))
        batch.drop_constraint(op.f("ck_timeline_spans_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_timeline_spans_kind"), sa.text(_KINDS_0010))
    op.create_index("ix_timeline_spans_run_id_round", "timeline_spans", ["run_id", "round"])


def downgrade() -> None:
    op.drop_index("ix_timeline_spans_run_id_round", table_name="timeline_spans")
    # The old check refuses the pipeline's spans: they go, with the table of its stages.
    op.execute("DELETE FROM timeline_spans WHERE kind IN ('forward', 'backward')")
    with op.batch_alter_table("timeline_spans") as batch:
        batch.drop_constraint(op.f("ck_timeline_spans_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_timeline_spans_kind"), sa.text(_KINDS_0008))
        batch.drop_column("step")
        batch.drop_column("microbatch")
    op.drop_index(op.f("ix_pipeline_stages_run_id"), table_name="pipeline_stages")
    op.drop_table("pipeline_stages")

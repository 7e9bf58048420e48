"""Gossip: each replica's consensus distance (datacenter_rounds, rounds) and what each datacenter-to-datacenter link
carried per round (link_rounds).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 07:00:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: Union[str, Sequence[str], None] = "0008"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("datacenter_rounds") as batch:
        batch.add_column(sa.Column("consensus_distance", sa.Float(), nullable=True))
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(sa.Column("consensus_distance", sa.Float(), nullable=True))
    op.create_table(
        "link_rounds",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("src", sa.String(length=128), nullable=False),
        sa.Column("dst", sa.String(length=128), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("in_flight_s", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_link_rounds_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_link_rounds")),
        sa.UniqueConstraint("run_id", "round", "src", "dst", name=op.f("uq_link_rounds_run_id_round_src_dst")),
    )
    op.create_index(op.f("ix_link_rounds_run_id"), "link_rounds", ["run_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_link_rounds_run_id"), table_name="link_rounds")
    op.drop_table("link_rounds")
    with op.batch_alter_table("rounds") as batch:
        batch.drop_column("consensus_distance")
    with op.batch_alter_table("datacenter_rounds") as batch:
        batch.drop_column("consensus_distance")

"""Streaming runs: one row per datacenter and fragment exchange (fragment_exchanges).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 05:40:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: Union[str, Sequence[str], None] = "0006"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "fragment_exchanges",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("exchange", sa.Integer(), nullable=False),
        sa.Column("fragment", sa.Integer(), nullable=False),
        sa.Column("datacenter", sa.String(length=128), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("bytes_up", sa.BigInteger(), nullable=False),
        sa.Column("bytes_down", sa.BigInteger(), nullable=False),
        sa.Column("sent_step", sa.BigInteger(), nullable=True),
        sa.Column("compute_s", sa.Float(), nullable=True),
        sa.Column("idle_s", sa.Float(), nullable=True),
        sa.Column("round_s", sa.Float(), nullable=True),
        sa.CheckConstraint("status IN ('ok', 'failed', 'timeout', 'rejected')", name=op.f("ck_fragment_exchanges_status")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_fragment_exchanges_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fragment_exchanges")),
        sa.UniqueConstraint("run_id", "exchange", "datacenter", name=op.f("uq_fragment_exchanges_run_id_exchange_datacenter")),
    )
    op.create_index(op.f("ix_fragment_exchanges_run_id"), "fragment_exchanges", ["run_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_fragment_exchanges_run_id"), table_name="fragment_exchanges")
    op.drop_table("fragment_exchanges")

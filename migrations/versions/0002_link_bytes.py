"""Bytes measured on each datacenter's link per round (to cross-check the payload sizes).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 13:10:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: Union[str, Sequence[str], None] = "0001"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("datacenter_rounds") as batch:
        batch.add_column(sa.Column("link_bytes_up", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("link_bytes_down", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("datacenter_rounds") as batch:
        batch.drop_column("link_bytes_down")
        batch.drop_column("link_bytes_up")

"""The fourth duration of a datacenter's round: idle_s, the time its trainer waited for the WAN or the coordinator.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 05:20:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: Union[str, Sequence[str], None] = "0005"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("datacenter_rounds") as batch:
        batch.add_column(sa.Column("idle_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("datacenter_rounds") as batch:
        batch.drop_column("idle_s")

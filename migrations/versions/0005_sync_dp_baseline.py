"""The sync-dp baseline: runs.baseline may be 'sync-dp' (synchronous data parallel measured across the emulated WAN).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 21:00:00
"""
from typing import Sequence, Union

from alembic import op

revision: str = "0005"
down_revision: Union[str, Sequence[str], None] = "0004"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

_BEFORE = "baseline IN ('none', 'all-workers', 'sequential')"
_AFTER = "baseline IN ('none', 'all-workers', 'sequential', 'sync-dp')"


def _replace(condition: str) -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint(op.f("ck_runs_baseline"), type_="check")
        batch.create_check_constraint(op.f("ck_runs_baseline"), condition)


def upgrade() -> None:
    _replace(_AFTER)


def downgrade() -> None:
    op.execute("DELETE FROM runs WHERE baseline = 'sync-dp'")
    _replace(_BEFORE)

"""Pipeline replicas: a pipeline_stages row names its replica (the pipeline it belongs to, 0 first, in config order;
0 for every row written before), and a round holds one row per replica and stage.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 15:00:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: Union[str, Sequence[str], None] = "0010"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    # SQLite copies the table (batch mode); PostgreSQL alters it in place
    with op.batch_alter_table("pipeline_stages") as batch:
        batch.add_column(sa.Column("replica", sa.Integer(), server_default="0", nullable=False))
        batch.drop_constraint(op.f("uq_pipeline_stages_run_id_round_stage"), type_="unique")
        batch.create_unique_constraint(op.f("uq_pipeline_stages_run_id_round_replica_stage"),
                                       ["run_id", "round", "replica", "stage"])


def downgrade() -> None:
    # 0010 keeps one row per round and stage: the rows of replicas after the first go
    op.execute("DELETE FROM pipeline_stages WHERE replica > 0")
    with op.batch_alter_table("pipeline_stages") as batch:
        batch.drop_constraint(op.f("uq_pipeline_stages_run_id_round_replica_stage"), type_="unique")
        batch.create_unique_constraint(op.f("uq_pipeline_stages_run_id_round_stage"), ["run_id", "round", "stage"])
        batch.drop_column("replica")

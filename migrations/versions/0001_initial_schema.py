"""Initial schema: runs, rounds, datacenter_rounds, async_updates, events, datacenters, checkpoints.

The tables of DESIGN.md "SQL schema" (see crossdc/db/models.py).

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 12:08:57.857181

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0001'
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('datacenters',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('region', sa.Text(), nullable=True),
    sa.Column('gpus', sa.Integer(), nullable=True),
    sa.Column('public_key', sa.Text(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('enrolled_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen', sa.DateTime(timezone=True), nullable=True),
    sa.Column('link_bandwidth_mbps', sa.Float(), nullable=True),
    sa.Column('link_rtt_ms', sa.Float(), nullable=True),
    sa.CheckConstraint("status IN ('active', 'suspended', 'revoked')", name=op.f('ck_datacenters_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_datacenters')),
    sa.UniqueConstraint('name', name=op.f('uq_datacenters_name'))
    )
    op.create_table('runs',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('strategy', sa.Text(), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('flower_run_ids', sa.Text(), nullable=False),
    sa.Column('baseline', sa.String(length=16), nullable=False),
    sa.Column('rounds_planned', sa.Integer(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('last_heartbeat', sa.DateTime(timezone=True), nullable=True),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.CheckConstraint("baseline IN ('none', 'all-workers', 'sequential')", name=op.f('ck_runs_baseline')),
    sa.CheckConstraint("status IN ('running', 'finished', 'failed', 'interrupted')", name=op.f('ck_runs_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs'))
    )
    op.create_index(op.f('ix_runs_status'), 'runs', ['status'], unique=False)
    op.create_table('async_updates',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('datacenter', sa.String(length=128), nullable=False),
    sa.Column('base_version', sa.BigInteger(), nullable=False),
    sa.Column('applied_version', sa.BigInteger(), nullable=True),
    sa.Column('staleness', sa.Integer(), nullable=False),
    sa.Column('scale', sa.Float(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('bytes_up', sa.BigInteger(), nullable=False),
    sa.CheckConstraint("status IN ('applied', 'discarded')", name=op.f('ck_async_updates_status')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_async_updates_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_async_updates')),
    sa.UniqueConstraint('run_id', 'seq', name=op.f('uq_async_updates_run_id_seq'))
    )
    op.create_index(op.f('ix_async_updates_run_id'), 'async_updates', ['run_id'], unique=False)
    op.create_table('checkpoints',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('round', sa.Integer(), nullable=False),
    sa.Column('uri', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_checkpoints_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('run_id', 'round', name=op.f('uq_checkpoints_run_id_round'))
    )
    op.create_index(op.f('ix_checkpoints_run_id'), 'checkpoints', ['run_id'], unique=False)
    op.create_table('datacenter_rounds',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('round', sa.Integer(), nullable=False),
    sa.Column('datacenter', sa.String(length=128), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('bytes_up', sa.BigInteger(), nullable=False),
    sa.Column('bytes_down', sa.BigInteger(), nullable=False),
    sa.Column('bytes_up_raw', sa.BigInteger(), nullable=False),
    sa.Column('compute_s', sa.Float(), nullable=True),
    sa.Column('comm_s', sa.Float(), nullable=True),
    sa.Column('overhead_s', sa.Float(), nullable=True),
    sa.Column('round_s', sa.Float(), nullable=True),
    sa.Column('comm_source', sa.Text(), nullable=True),
    sa.Column('train_loss', sa.Float(), nullable=True),
    sa.Column('num_examples', sa.BigInteger(), nullable=True),
    sa.Column('drift_l2', sa.Float(), nullable=True),
    sa.Column('update_cosine', sa.Float(), nullable=True),
    sa.Column('staleness', sa.Integer(), nullable=True),
    sa.CheckConstraint("status IN ('ok', 'failed', 'timeout', 'rejected')", name=op.f('ck_datacenter_rounds_status')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_datacenter_rounds_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_datacenter_rounds')),
    sa.UniqueConstraint('run_id', 'round', 'datacenter', name=op.f('uq_datacenter_rounds_run_id_round_datacenter'))
    )
    op.create_index(op.f('ix_datacenter_rounds_run_id'), 'datacenter_rounds', ['run_id'], unique=False)
    op.create_table('events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('round', sa.Integer(), nullable=True),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('datacenter', sa.String(length=128), nullable=True),
    sa.Column('detail', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_events_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    op.create_index(op.f('ix_events_run_id'), 'events', ['run_id'], unique=False)
    op.create_table('rounds',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('round', sa.Integer(), nullable=False),
    sa.Column('tau', sa.Integer(), nullable=True),
    sa.Column('val_loss', sa.Float(), nullable=True),
    sa.Column('val_accuracy', sa.Float(), nullable=True),
    sa.Column('bytes_up', sa.BigInteger(), nullable=False),
    sa.Column('bytes_down', sa.BigInteger(), nullable=False),
    sa.Column('bytes_up_raw', sa.BigInteger(), nullable=False),
    sa.Column('wall_s', sa.Float(), nullable=True),
    sa.Column('eval_s', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_rounds_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rounds')),
    sa.UniqueConstraint('run_id', 'round', name=op.f('uq_rounds_run_id_round'))
    )
    op.create_index(op.f('ix_rounds_run_id'), 'rounds', ['run_id'], unique=False)



def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index(op.f('ix_rounds_run_id'), table_name='rounds')
    op.drop_table('rounds')
    op.drop_index(op.f('ix_events_run_id'), table_name='events')
    op.drop_table('events')
    op.drop_index(op.f('ix_datacenter_rounds_run_id'), table_name='datacenter_rounds')
    op.drop_table('datacenter_rounds')
    op.drop_index(op.f('ix_checkpoints_run_id'), table_name='checkpoints')
    op.drop_table('checkpoints')
    op.drop_index(op.f('ix_async_updates_run_id'), table_name='async_updates')
    op.drop_table('async_updates')
    op.drop_index(op.f('ix_runs_status'), table_name='runs')
    op.drop_table('runs')
    op.drop_table('datacenters')

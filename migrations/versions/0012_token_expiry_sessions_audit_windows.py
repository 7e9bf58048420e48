"""Trust: API tokens may expire (api_tokens.expires_at), dashboard logins (api_sessions: a browser's session cookie,
stored as its hash, tied to the token it was opened with), and refusals of callers without a live token aggregated
in the audit log (audit_log.count, last_at and window_key: one row per client, action, reason and window).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-08 10:00:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: Union[str, Sequence[str], None] = "0011"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

_BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "api_sessions",
        sa.Column("id", _BigId, autoincrement=True, nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("session_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["token_id"], ["api_tokens.id"], name=op.f("fk_api_sessions_token_id_api_tokens"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_sessions")),
        sa.UniqueConstraint("session_hash", name=op.f("uq_api_sessions_session_hash")),
    )
    op.create_index(op.f("ix_api_sessions_token_id"), "api_sessions", ["token_id"], unique=False)
    # SQLite copies the table (batch mode); PostgreSQL alters it in place. Rows written before are one act each.
    with op.batch_alter_table("audit_log") as batch:
        batch.add_column(sa.Column("count", sa.Integer(), server_default="1", nullable=False))
        batch.add_column(sa.Column("last_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("window_key", sa.String(length=64), nullable=True))
        batch.create_unique_constraint(op.f("uq_audit_log_window_key"), ["window_key"])


def downgrade() -> None:
    # 0011 has one row per act: an aggregated row keeps its first act (its count and last time are lost)
    with op.batch_alter_table("audit_log") as batch:
        batch.drop_constraint(op.f("uq_audit_log_window_key"), type_="unique")
        batch.drop_column("window_key")
        batch.drop_column("last_at")
        batch.drop_column("count")
    op.drop_index(op.f("ix_api_sessions_token_id"), table_name="api_sessions")
    op.drop_table("api_sessions")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("expires_at")

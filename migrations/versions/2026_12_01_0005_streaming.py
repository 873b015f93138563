"""Streaming: what a streaming client saw of each request (first chunk, gaps between chunks).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 16:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stream_metrics",
        sa.Column("request_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("ttft_ms", sa.Double(), nullable=True),
        sa.Column("itl_ms", postgresql.ARRAY(sa.Double()), server_default=sa.text("'{}'"), nullable=False),
        sa.Column("num_chunks", sa.Integer(), nullable=False),
        sa.Column("num_restarts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("disconnected", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.ForeignKeyConstraint(["request_id"], ["requests.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("request_id"),
    )


def downgrade() -> None:
    op.drop_table("stream_metrics")

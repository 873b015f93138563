"""Token-level serving: a batch record is a stretch of steps with its peak retained tokens; preemptions.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 13:40:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("kv_cache_tokens", sa.BigInteger(), nullable=True))
    op.add_column("batches", sa.Column("num_preempted", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.add_column("requests", sa.Column("num_preemptions", sa.Integer(), server_default=sa.text("0"),
                                        nullable=False))


def downgrade() -> None:
    op.drop_column("requests", "num_preemptions")
    op.drop_column("batches", "num_preempted")
    op.drop_column("batches", "kv_cache_tokens")

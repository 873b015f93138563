"""Prefix caching: each result's prompt tokens served from the prefix cache, and each batch record's
prefix-cache look-ups and hits (tokens) with its paged-cache blocks at the KV peak.

Every new column is NOT NULL with a server default of 0, so rows written before read as "nothing cached,
nothing looked up, not paged": a run stored before has no hit rate (n/a), never 0 %.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 16:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH_COLUMNS = (("num_prefix_query_tokens", sa.BigInteger), ("num_prefix_hit_tokens", sa.BigInteger),
                 ("kv_block_size", sa.Integer), ("kv_blocks_shared", sa.Integer), ("kv_blocks_private", sa.Integer))


def upgrade() -> None:
    op.add_column("results", sa.Column("num_cached_tokens", sa.Integer(), server_default=sa.text("0"),
                                       nullable=False))
    for name, kind in BATCH_COLUMNS:
        op.add_column("batches", sa.Column(name, kind(), server_default=sa.text("0"), nullable=False))


def downgrade() -> None:
    for name, _ in reversed(BATCH_COLUMNS):
        op.drop_column("batches", name)
    op.drop_column("results", "num_cached_tokens")

"""Retention: batch records found by age (the control plane deletes old ones in small batches).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 16:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # NOTE: requests are found by age through ix_requests_enqueued_at (migration 0001); batches had no index
    # that starts with a time, so each slice of the retention task would read the whole table
    op.create_index("ix_batches_finished_at", "batches", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_batches_finished_at", table_name="batches")

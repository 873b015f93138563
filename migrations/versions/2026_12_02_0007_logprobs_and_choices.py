"""Sampling fields a local model honours: each result's token log-probabilities, and the choices of an n > 1
request (rows that answer one request together, in order).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 16:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("results", sa.Column("logprobs", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column("requests", sa.Column("first_choice_id", postgresql.UUID(as_uuid=True), nullable=True))
    op.add_column("requests", sa.Column("choice_index", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.create_index("ix_requests_first_choice_id", "requests", ["first_choice_id"])


def downgrade() -> None:
    op.drop_index("ix_requests_first_choice_id", table_name="requests")
    op.drop_column("requests", "choice_index")
    op.drop_column("requests", "first_choice_id")
    op.drop_column("results", "logprobs")

"""Fair share of bulk work: each tenant's weight (a tenant without a row weighs 1).

A config's bulk queue is shared between the batch jobs feeding it in proportion to their tenants' weights, a
tenant's share split among its jobs (servelab/jobs/share.py). Set with `servelab keys weight`.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 12:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenant_weights",
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("weight", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("weight > 0", name=op.f("ck_tenant_weights_weight_positive")),
        sa.PrimaryKeyConstraint("tenant", name=op.f("pk_tenant_weights")),
    )


def downgrade() -> None:
    op.drop_table("tenant_weights")

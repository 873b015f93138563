"""The lab: runs (and the requests each sent), comparisons, sweeps.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 17:50:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NOW = sa.text("now()")
TIMESTAMP = sa.DateTime(timezone=True)
JSONB = postgresql.JSONB(astext_type=sa.Text())


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("serving_config_name", sa.Text(), nullable=False),
        sa.Column("config_hash", sa.Text(), nullable=False),
        sa.Column("config", JSONB, nullable=False),
        sa.Column("workload_name", sa.Text(), nullable=False),
        sa.Column("workload_fingerprint", sa.Text(), nullable=False),
        sa.Column("workload", JSONB, nullable=False),
        sa.Column("hardware", JSONB, nullable=False),
        sa.Column("software", JSONB, nullable=False),
        sa.Column("worker_name", sa.Text(), nullable=False),
        sa.Column("plan_name", sa.Text(), nullable=True),
        sa.Column("repeat_index", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=False),
        sa.Column("finished_at", TIMESTAMP, nullable=False),
        sa.Column("summary", JSONB, nullable=False),
        sa.Column("quality", JSONB, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_index("ix_runs_workload_fingerprint", "runs", ["workload_fingerprint"])
    op.create_index("ix_runs_started_at", "runs", ["started_at"])
    op.create_table(
        "run_requests",
        sa.Column("run_id", sa.UUID(), nullable=False),
        sa.Column("request_id", sa.UUID(), nullable=False),
        sa.Column("item_index", sa.Integer(), nullable=False),
        sa.Column("scheduled_offset_ms", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_run_requests_run_id_runs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["request_id"], ["requests.id"], name=op.f("fk_run_requests_request_id_requests"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "request_id", name=op.f("pk_run_requests")),
    )
    op.create_index("ix_run_requests_request_id", "run_requests", ["request_id"])
    op.create_table(
        "comparisons",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("plan_name", sa.Text(), nullable=False),
        sa.Column("plan", JSONB, nullable=False),
        sa.Column("baseline_run_ids", postgresql.ARRAY(sa.UUID()), nullable=False),
        sa.Column("candidate_run_ids", postgresql.ARRAY(sa.UUID()), nullable=False),
        sa.Column("report", JSONB, nullable=False),
        sa.Column("created_at", TIMESTAMP, server_default=NOW, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_comparisons")),
    )
    op.create_table(
        "sweeps",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("report", JSONB, nullable=False),
        sa.Column("hardware", JSONB, nullable=False),
        sa.Column("created_at", TIMESTAMP, server_default=NOW, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweeps")),
    )


def downgrade() -> None:
    op.drop_table("sweeps")
    op.drop_table("comparisons")
    op.drop_index("ix_run_requests_request_id", table_name="run_requests")
    op.drop_table("run_requests")
    op.drop_index("ix_runs_started_at", table_name="runs")
    op.drop_index("ix_runs_workload_fingerprint", table_name="runs")
    op.drop_table("runs")

"""Bulk jobs, files, API keys (api_keys, files, batch_jobs, batch_line_errors) and an index of requests by tenant.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 17:45:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# NOTE: values written out, not imported from servelab: a migration must not change when the code does.
BATCH_STATUS = postgresql.ENUM(
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled",
    name="batch_status", create_type=False,
)
NOW = sa.text("now()")


def _timestamp(name: str, *, nullable: bool = True, server_default: sa.TextClause | None = None) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable, server_default=server_default)


def upgrade() -> None:
    BATCH_STATUS.create(op.get_bind())
    op.create_table(
        "api_keys",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("key_hash", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        _timestamp("created_at", nullable=False, server_default=NOW),
        _timestamp("revoked_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index("ix_api_keys_tenant", "api_keys", ["tenant"])

    op.create_table(
        "files",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("purpose", sa.Text(), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        _timestamp("created_at", nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index("ix_files_tenant_created_at", "files", ["tenant", "created_at"])
    # NOTE: stored uncompressed, so ingest's substring() reads only the slice it asks for, not the whole file.
    op.execute("ALTER TABLE files ALTER COLUMN content SET STORAGE EXTERNAL")

    op.create_table(
        "batch_jobs",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("input_file_id", sa.Text(), nullable=False),
        sa.Column("completion_window", sa.Text(), nullable=False),
        sa.Column("metadata", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("status", BATCH_STATUS, server_default="validating", nullable=False),
        sa.Column("errors", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("ingest_offset", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("num_lines", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("is_ingested", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("request_counts", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("output_file_id", sa.Text(), nullable=True),
        sa.Column("error_file_id", sa.Text(), nullable=True),
        _timestamp("created_at", nullable=False, server_default=NOW),
        _timestamp("expires_at", nullable=False),
        *(_timestamp(name) for name in ("in_progress_at", "finalizing_at", "completed_at", "failed_at",
                                        "expired_at", "cancelling_at", "cancelled_at")),
        sa.ForeignKeyConstraint(["input_file_id"], ["files.id"], name=op.f("fk_batch_jobs_input_file_id_files")),
        sa.ForeignKeyConstraint(["output_file_id"], ["files.id"], name=op.f("fk_batch_jobs_output_file_id_files")),
        sa.ForeignKeyConstraint(["error_file_id"], ["files.id"], name=op.f("fk_batch_jobs_error_file_id_files")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batch_jobs")),
    )
    op.create_index("ix_batch_jobs_tenant_created_at", "batch_jobs", ["tenant", "created_at"])
    op.create_index("ix_batch_jobs_status", "batch_jobs", ["status"])

    op.create_table(
        "batch_line_errors",
        sa.Column("batch_job_id", sa.UUID(), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=True),
        sa.Column("code", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["batch_job_id"], ["batch_jobs.id"],
                                name=op.f("fk_batch_line_errors_batch_job_id_batch_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("batch_job_id", "line_no", name=op.f("pk_batch_line_errors")),
    )

    op.create_index("ix_requests_tenant_status", "requests", ["tenant", "status"])


def downgrade() -> None:
    op.drop_index("ix_requests_tenant_status", table_name="requests")
    op.drop_table("batch_line_errors")
    op.drop_table("batch_jobs")
    op.drop_table("files")
    op.drop_table("api_keys")
    BATCH_STATUS.drop(op.get_bind())

"""Initial schema: serving configs, requests, results, batches, request metrics, workers.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 17:23:44+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# NOTE: the values are written out, not imported from servelab: a migration must not change when the
# code does. Declaration order is the enum's sort order in PostgreSQL (queued < running < terminal).
REQUEST_STATUS = postgresql.ENUM(
    "queued", "running", "succeeded", "failed", "cancelled", name="request_status", create_type=False
)
STREAM_KIND = postgresql.ENUM("interactive", "bulk", name="stream_kind", create_type=False)
FINISH_REASON = postgresql.ENUM("stop", "length", "error", "cancelled", name="finish_reason", create_type=False)
ENUMS = (REQUEST_STATUS, STREAM_KIND, FINISH_REASON)

NOW = sa.text("now()")


def _timestamp(name: str, *, nullable: bool = False, server_default: sa.TextClause | None = None) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable, server_default=server_default)


def upgrade() -> None:
    bind = op.get_bind()
    for enum_type in ENUMS:
        enum_type.create(bind)

    op.create_table(
        "serving_configs",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("config_hash", sa.Text(), nullable=False),
        sa.Column("config", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        _timestamp("created_at", server_default=NOW),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_serving_configs")),
        sa.UniqueConstraint("name", "config_hash", name=op.f("uq_serving_configs_name_config_hash")),
    )

    op.create_table(
        "requests",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("tenant", sa.Text(), server_default=sa.text("'default'"), nullable=False),
        sa.Column("serving_config_name", sa.Text(), nullable=False),
        sa.Column("stream", STREAM_KIND, nullable=False),
        sa.Column("status", REQUEST_STATUS, server_default="queued", nullable=False),
        sa.Column("priority", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("messages", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column(
            "sampling", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("batch_job_id", sa.UUID(), nullable=True),
        sa.Column("custom_id", sa.Text(), nullable=True),
        sa.Column("num_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        _timestamp("enqueued_at", server_default=NOW),
        _timestamp("started_at", nullable=True),
        _timestamp("first_token_at", nullable=True),
        _timestamp("finished_at", nullable=True),
        sa.Column("finish_reason", FINISH_REASON, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint("(prompt IS NULL) <> (messages IS NULL)", name=op.f("ck_requests_prompt_xor_messages")),
        sa.CheckConstraint("num_attempts >= 0", name=op.f("ck_requests_num_attempts_not_negative")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        sa.UniqueConstraint("batch_job_id", "custom_id", name=op.f("uq_requests_batch_job_id_custom_id")),
    )
    op.create_index("ix_requests_status_serving_config_name", "requests", ["status", "serving_config_name"])
    op.create_index("ix_requests_batch_job_id", "requests", ["batch_job_id"])
    op.create_index("ix_requests_enqueued_at", "requests", ["enqueued_at"])

    op.create_table(
        "results",
        sa.Column("request_id", sa.UUID(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("num_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("num_generated_tokens", sa.Integer(), nullable=False),
        sa.Column("token_ids", postgresql.ARRAY(sa.Integer()), nullable=False),
        _timestamp("created_at", server_default=NOW),
        sa.ForeignKeyConstraint(
            ["request_id"], ["requests.id"], name=op.f("fk_results_request_id_requests"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_results")),
    )

    op.create_table(
        "batches",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("worker_name", sa.Text(), nullable=False),
        sa.Column("serving_config_name", sa.Text(), nullable=False),
        sa.Column("config_hash", sa.Text(), nullable=False),
        sa.Column("num_requests", sa.Integer(), nullable=False),
        sa.Column("num_rows_per_step", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column("prefill_ms", sa.Double(), nullable=False),
        sa.Column("decode_ms", sa.Double(), nullable=False),
        sa.Column("num_prefill_tokens", sa.Integer(), nullable=False),
        sa.Column("num_decode_tokens", sa.Integer(), nullable=False),
        sa.Column("device", sa.Text(), nullable=False),
        sa.Column("weight_bytes", sa.BigInteger(), nullable=False),
        sa.Column("kv_cache_bytes", sa.BigInteger(), nullable=False),
        sa.Column("kv_cache_allocated_bytes", sa.BigInteger(), nullable=False),
        sa.Column("peak_working_bytes", sa.BigInteger(), nullable=False),
        sa.Column("peak_process_bytes", sa.BigInteger(), nullable=False),
        _timestamp("started_at"),
        _timestamp("finished_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_serving_config_name_started_at", "batches", ["serving_config_name", "started_at"])

    op.create_table(
        "request_metrics",
        sa.Column("request_id", sa.UUID(), nullable=False),
        sa.Column("batch_id", sa.UUID(), nullable=False),
        sa.Column("queue_ms", sa.Double(), nullable=False),
        sa.Column("ttft_ms", sa.Double(), nullable=True),
        sa.Column("tpot_ms", sa.Double(), nullable=True),
        sa.Column("e2e_ms", sa.Double(), nullable=True),
        sa.Column("itl_ms", postgresql.ARRAY(sa.Double()), server_default=sa.text("'{}'"), nullable=False),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_request_metrics_batch_id_batches"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["request_id"], ["requests.id"], name=op.f("fk_request_metrics_request_id_requests"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_request_metrics")),
    )
    op.create_index("ix_request_metrics_batch_id", "request_metrics", ["batch_id"])

    op.create_table(
        "workers",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("serving_config_name", sa.Text(), nullable=False),
        sa.Column("config_hash", sa.Text(), nullable=False),
        sa.Column("hardware", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("software", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        _timestamp("started_at", server_default=NOW),
        _timestamp("heartbeat_at", server_default=NOW),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        sa.UniqueConstraint("name", name=op.f("uq_workers_name")),
    )


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_table("request_metrics")  # its indexes go with it
    op.drop_table("batches")
    op.drop_table("results")
    op.drop_table("requests")
    op.drop_table("serving_configs")
    bind = op.get_bind()
    for enum_type in reversed(ENUMS):
        enum_type.drop(bind)

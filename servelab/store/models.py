"""The PostgreSQL schema as SQLAlchemy models: configs, requests, results, metrics, batches, workers.

Knows the tables, their keys and the indexes the queue, the worker and the dashboard rely on. Does not
know how rows are written or read (store functions do) and never changes the database itself: the schema
changes only through migrations/, and a test checks that these models and the migrations agree.
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Double,
    Enum,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from servelab.engine.outputs import FinishReason

# NOTE: fixed constraint names, so that migrations can name (and drop) what the models declare.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class RequestStatus(str, enum.Enum):
    """A request's state. Ordered: queued < running < a terminal state (succeeded, failed, cancelled).

    The PostgreSQL enum keeps this declaration order, so `status < 'succeeded'` means "not finished".
    """

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def rank(self) -> int:
        """0 queued, 1 running, 2 for every terminal state: they are siblings, not a sequence."""
        return {RequestStatus.QUEUED: 0, RequestStatus.RUNNING: 1}.get(self, 2)

    @property
    def is_terminal(self) -> bool:
        return self.rank == 2

    def can_move_to(self, other: RequestStatus) -> bool:
        """Forward only; running -> queued is the one step back (a lost worker's request is re-queued)."""
        if self is RequestStatus.RUNNING and other is RequestStatus.QUEUED:
            return True
        return other.rank > self.rank


class StreamKind(str, enum.Enum):
    """Which stream of its serving config a request waits in; the worker serves interactive first."""

    INTERACTIVE = "interactive"
    BULK = "bulk"


def _values(enum_cls: type[enum.Enum]) -> list[str]:
    return [member.value for member in enum_cls]


# NOTE: PostgreSQL enum types hold the lowercase values, not the Python member names.
REQUEST_STATUS = Enum(RequestStatus, name="request_status", values_callable=_values)
STREAM_KIND = Enum(StreamKind, name="stream_kind", values_callable=_values)
FINISH_REASON = Enum(FinishReason, name="finish_reason", values_callable=_values)

Timestamp = DateTime(timezone=True)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ServingConfigRow(Base):
    """One ServingConfig as served: the full config, so a run can always say exactly what it measured."""

    __tablename__ = "serving_configs"
    __table_args__ = (UniqueConstraint("name", "config_hash"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(Text)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())


class RequestRow(Base):
    """One generation request from the API or a bulk job; its id is what travels through the queue."""

    __tablename__ = "requests"
    __table_args__ = (
        CheckConstraint("(prompt IS NULL) <> (messages IS NULL)", name="prompt_xor_messages"),
        CheckConstraint("num_attempts >= 0", name="num_attempts_not_negative"),
        # NOTE: a bulk file's custom_id is unique within its job, which makes re-ingesting a line harmless.
        UniqueConstraint("batch_job_id", "custom_id"),
        Index("ix_requests_status_serving_config_name", "status", "serving_config_name"),
        Index("ix_requests_batch_job_id", "batch_job_id"),
        Index("ix_requests_enqueued_at", "enqueued_at"),
    )

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, default=uuid.uuid4, server_default=func.gen_random_uuid()
    )
    tenant: Mapped[str] = mapped_column(Text, default="default", server_default=text("'default'"))
    serving_config_name: Mapped[str] = mapped_column(Text)
    stream: Mapped[StreamKind] = mapped_column(STREAM_KIND)
    status: Mapped[RequestStatus] = mapped_column(
        REQUEST_STATUS, default=RequestStatus.QUEUED, server_default=RequestStatus.QUEUED.value
    )
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    prompt: Mapped[str | None] = mapped_column(Text)
    # NOTE: none_as_null: Python None must be SQL NULL (the check below), not the JSON value null.
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB(none_as_null=True))
    sampling: Mapped[dict[str, Any]] = mapped_column(JSONB, default=dict, server_default=text("'{}'::jsonb"))
    # NOTE: no foreign key yet: the batch_jobs table comes with the bulk-job migration.
    batch_job_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    custom_id: Mapped[str | None] = mapped_column(Text)
    # Started executions, counted by the worker when it claims the row (the stream's counter over-counts).
    num_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    enqueued_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(Timestamp)
    first_token_at: Mapped[datetime | None] = mapped_column(Timestamp)
    finished_at: Mapped[datetime | None] = mapped_column(Timestamp)
    finish_reason: Mapped[FinishReason | None] = mapped_column(FINISH_REASON)
    error: Mapped[str | None] = mapped_column(Text)


class ResultRow(Base):
    """The generated text of one request. Keyed by request id, so a redelivered request cannot insert twice."""

    __tablename__ = "results"

    request_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True
    )
    text: Mapped[str] = mapped_column(Text)
    num_prompt_tokens: Mapped[int] = mapped_column(Integer)
    num_generated_tokens: Mapped[int] = mapped_column(Integer)
    # NOTE: the generated ids themselves, so a token count can always be checked against the text.
    token_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())


class BatchRow(Base):
    """One engine batch: its shape per step, timings and memory (BatchTimings + MemoryBreakdown)."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_serving_config_name_started_at", "serving_config_name", "started_at"),)

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    worker_name: Mapped[str] = mapped_column(Text)
    serving_config_name: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(Text)
    num_requests: Mapped[int] = mapped_column(Integer)
    num_rows_per_step: Mapped[list[int]] = mapped_column(ARRAY(Integer))  # step 0 is the prefill
    prefill_ms: Mapped[float] = mapped_column(Double)
    decode_ms: Mapped[float] = mapped_column(Double)
    num_prefill_tokens: Mapped[int] = mapped_column(Integer)
    num_decode_tokens: Mapped[int] = mapped_column(Integer)
    device: Mapped[str] = mapped_column(Text)
    weight_bytes: Mapped[int] = mapped_column(BigInteger)
    kv_cache_bytes: Mapped[int] = mapped_column(BigInteger)
    kv_cache_allocated_bytes: Mapped[int] = mapped_column(BigInteger)
    peak_working_bytes: Mapped[int] = mapped_column(BigInteger)
    peak_process_bytes: Mapped[int] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(Timestamp)
    finished_at: Mapped[datetime] = mapped_column(Timestamp)


class RequestMetricsRow(Base):
    """One request's latencies as served (Completion timings plus queue wait), and the batch that served it."""

    __tablename__ = "request_metrics"
    __table_args__ = (Index("ix_request_metrics_batch_id", "batch_id"),)

    request_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True
    )
    batch_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("batches.id", ondelete="CASCADE"))
    queue_ms: Mapped[float] = mapped_column(Double)
    ttft_ms: Mapped[float | None] = mapped_column(Double)
    tpot_ms: Mapped[float | None] = mapped_column(Double)
    e2e_ms: Mapped[float | None] = mapped_column(Double)
    itl_ms: Mapped[list[float]] = mapped_column(ARRAY(Double), default=list, server_default=text("'{}'"))


class WorkerRow(Base):
    """A GPU worker process: the one serving config it serves, where it runs, and when it was last alive."""

    __tablename__ = "workers"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    serving_config_name: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(Text)
    hardware: Mapped[dict[str, Any]] = mapped_column(JSONB)
    software: Mapped[dict[str, Any]] = mapped_column(JSONB)
    started_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    heartbeat_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())

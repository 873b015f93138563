"""The PostgreSQL schema as SQLAlchemy models: configs, requests, results, metrics, batches, workers.

Knows the tables, their keys and the indexes the queue, the worker and the dashboard rely on. Does not
know how rows are written or read (store functions do) and never changes the database itself: the schema
changes only through migrations/, and a test checks that these models and the migrations agree. Columns that
hold a client's text are KeptText / KeptJSONB (store/pgtext.py): any text, NUL included, reads back as written.
Past 400 lines as one piece: one schema, read whole by that test and by Alembic's autogenerate.
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
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

from servelab.request import FinishReason, RequestStatus, StreamKind
from servelab.store.pgtext import KeptJSONB, KeptText

# NOTE: fixed constraint names, so that migrations can name (and drop) what the models declare.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _values(enum_cls: type[enum.Enum]) -> list[str]:
    return [member.value for member in enum_cls]


# NOTE: PostgreSQL enum types hold the lowercase values, not the Python member names.
REQUEST_STATUS = Enum(RequestStatus, name="request_status", values_callable=_values)
STREAM_KIND = Enum(StreamKind, name="stream_kind", values_callable=_values)
FINISH_REASON = Enum(FinishReason, name="finish_reason", values_callable=_values)

Timestamp = DateTime(timezone=True)
ZERO = text("0")  # NOTE: a server default for tables with a column named `text`, which hides the function there


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
        Index("ix_requests_first_choice_id", "first_choice_id"),
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
    prompt: Mapped[str | None] = mapped_column(KeptText)
    # NOTE: none_as_null: Python None must be SQL NULL (the check below), not the JSON value null.
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(KeptJSONB(none_as_null=True))
    sampling: Mapped[dict[str, Any]] = mapped_column(KeptJSONB, default=dict, server_default=text("'{}'::jsonb"))
    # NOTE: no foreign key yet: the batch_jobs table comes with the bulk-job migration.
    batch_job_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    custom_id: Mapped[str | None] = mapped_column(KeptText)
    # Started executions, counted by the worker when it claims the row (the stream's counter over-counts).
    num_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    num_preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))  # left a batch unfinished
    enqueued_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(Timestamp)
    first_token_at: Mapped[datetime | None] = mapped_column(Timestamp)
    finished_at: Mapped[datetime | None] = mapped_column(Timestamp)
    finish_reason: Mapped[FinishReason | None] = mapped_column(FINISH_REASON)
    error: Mapped[str | None] = mapped_column(KeptText)
    # NOTE: an n > 1 completion is n rows decoded together: each names the first (its own id, for the first) and
    # its index; a plain request has none. One request's choices answer together, in choice_index order.
    first_choice_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    choice_index: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))


class ResultRow(Base):
    """The generated text of one request. Keyed by request id, so a redelivered request cannot insert twice."""

    __tablename__ = "results"

    request_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True
    )
    text: Mapped[str] = mapped_column(KeptText)
    num_prompt_tokens: Mapped[int] = mapped_column(Integer)
    num_generated_tokens: Mapped[int] = mapped_column(Integer)
    # NOTE: the generated ids themselves, so a token count can always be checked against the text.
    token_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    # One entry per generated token when the request asked (TokenLogprobs.to_stored): id, bytes, logprob,
    # text_offset and the top alternatives.
    logprobs: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB(none_as_null=True))
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    # Prompt tokens served from the prefix cache, not prefilled (migration 0012; rows before it read 0):
    # the answer's usage.prompt_tokens_details.cached_tokens
    num_cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=ZERO)


class BatchRow(Base):
    """A stretch of engine steps, up to a step in which rows finished: rows per pass, timings and memory
    (BatchTimings + MemoryBreakdown). Under the window policy, a closed batch is one or more of these."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_serving_config_name_started_at", "serving_config_name", "started_at"),
                      Index("ix_batches_finished_at", "finished_at"))  # retention finds old batches by age

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
    # NOTE: None on batches stored before token-level serving; queries.peak_retained_tokens rebuilds them
    kv_cache_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    num_preempted: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    started_at: Mapped[datetime] = mapped_column(Timestamp)
    finished_at: Mapped[datetime] = mapped_column(Timestamp)
    # NOTE: migration 0012: prompt tokens looked up in the prefix cache and, of those, found there (vLLM's
    # prefix_cache_queries / _hits); 0 looked up (caching off, transformers' decoder, a batch stored before)
    # leaves the hit rate undefined, never 0 %. Blocks at the KV peak; kv_block_size 0: the cache is not paged.
    num_prefix_query_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    num_prefix_hit_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    kv_block_size: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    kv_blocks_shared: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    kv_blocks_private: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))


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


class StreamMetricsRow(Base):
    """One streamed request as its client saw it: the API's time from arrival to the first chunk, the gaps
    between chunks; written by the API at the end of the stream, beside the worker's figures."""

    __tablename__ = "stream_metrics"

    request_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True
    )
    ttft_ms: Mapped[float | None] = mapped_column(Double)
    itl_ms: Mapped[list[float]] = mapped_column(ARRAY(Double), default=list, server_default=text("'{}'"))
    num_chunks: Mapped[int] = mapped_column(Integer)
    num_restarts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    disconnected: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))


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


# --- bulk jobs, files and keys (migration 0002) ---

# NOTE: imported here, not in the header, so that this section is a pure append.
from sqlalchemy import LargeBinary  # noqa: E402


class BatchStatus(str, enum.Enum):
    """A batch job's state, as the OpenAI Batch API names them. Terminal: failed, completed, expired, cancelled."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


BATCH_STATUS = Enum(BatchStatus, name="batch_status", values_callable=_values)


class TenantQueueRow(Base):
    """How many interactive requests of a tenant are queued now: what admission holds against the limit.

    NOTE: written only by triggers on requests (migration 0008), in the transaction that inserts, re-statuses
    or deletes the rows, so it is exactly COUNT(*) of the tenant's queued rows with no batch job, at every
    commit, whatever process changed them and however it ended. Admission locks the row (SELECT FOR UPDATE
    through an upsert) instead of counting.
    """

    __tablename__ = "tenant_queues"
    __table_args__ = (CheckConstraint("num_queued >= 0", name="num_queued_not_negative"),)

    tenant: Mapped[str] = mapped_column(Text, primary_key=True)
    num_queued: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))


class TenantWeightRow(Base):
    """A tenant's weight in the fair share of bulk work (migration 0011); a tenant without a row weighs 1."""

    __tablename__ = "tenant_weights"
    __table_args__ = (CheckConstraint("weight > 0", name="weight_positive"),)

    tenant: Mapped[str] = mapped_column(Text, primary_key=True)
    weight: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())


class ApiKeyRow(Base):
    """An API key of one tenant. Only the key's sha256 is stored: a leaked table leaks no key."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    key_hash: Mapped[str] = mapped_column(Text, unique=True)
    tenant: Mapped[str] = mapped_column(Text, index=True)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(Timestamp)


class FileRow(Base):
    """An uploaded batch input file or a job's output / error file; its bytes are its parts (FilePartRow).

    NOTE: in Postgres, not under state_dir: the api and the jobs-worker run on different hosts.
    """

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created_at", "tenant", "created_at"),
                      Index("ix_files_expires_at", "expires_at"))

    id: Mapped[str] = mapped_column(Text, primary_key=True)  # "file-<hex>", the OpenAI shape
    tenant: Mapped[str] = mapped_column(Text)
    purpose: Mapped[str] = mapped_column(Text)  # "batch" (input) or "batch_output"
    filename: Mapped[str] = mapped_column(KeptText)
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    # NOTE: a file past expires_at, or deleted, is gone for every read; a deleted file's content is erased and
    # its row stays (batches name their files through foreign keys), as do expired rows until the purge erases them
    expires_at: Mapped[datetime | None] = mapped_column(Timestamp)
    deleted_at: Mapped[datetime | None] = mapped_column(Timestamp)


class FilePartRow(Base):
    """A stretch of a file's bytes (migration 0009): files are written and read a part at a time, so no
    process holds a whole file. A file's parts cover [0, num_bytes) without gaps, in byte_offset order."""

    __tablename__ = "file_parts"

    file_id: Mapped[str] = mapped_column(Text, ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    byte_offset: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # of the part's first byte
    content: Mapped[bytes] = mapped_column(LargeBinary)


class BatchJobRow(Base):
    """One bulk job: its input file, lifecycle timestamps, and how far ingest has read the file."""

    __tablename__ = "batch_jobs"
    __table_args__ = (
        Index("ix_batch_jobs_tenant_created_at", "tenant", "created_at"),
        Index("ix_batch_jobs_status", "status"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    tenant: Mapped[str] = mapped_column(Text)
    endpoint: Mapped[str] = mapped_column(Text)
    input_file_id: Mapped[str] = mapped_column(Text, ForeignKey("files.id"))
    completion_window: Mapped[str] = mapped_column(Text)
    # NOTE: "metadata" is reserved on declarative classes, hence the attribute name.
    job_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", KeptJSONB(none_as_null=True))
    status: Mapped[BatchStatus] = mapped_column(
        BATCH_STATUS, default=BatchStatus.VALIDATING, server_default=BatchStatus.VALIDATING.value
    )
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(KeptJSONB(none_as_null=True))
    # Ingest progress: the byte offset of the first unread line and lines read so far; committed with the
    # rows those lines created, so a re-run ingest resumes exactly where the last commit left off.
    ingest_offset: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    num_lines: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    is_ingested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    # NOTE: written when the job ends, so its counts agree with its files whatever finishes later.
    request_counts: Mapped[dict[str, int] | None] = mapped_column(JSONB(none_as_null=True))
    output_file_id: Mapped[str | None] = mapped_column(Text, ForeignKey("files.id"))
    error_file_id: Mapped[str | None] = mapped_column(Text, ForeignKey("files.id"))
    # NOTE: OpenAI's output_expires_after (anchor created_at): the output and error files expire this long
    # after they are written; None keeps them until deleted
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer)
    # input / output / total tokens of the succeeded requests, written with request_counts when the job ends
    usage: Mapped[dict[str, int] | None] = mapped_column(JSONB(none_as_null=True))
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(Timestamp)
    in_progress_at: Mapped[datetime | None] = mapped_column(Timestamp)
    finalizing_at: Mapped[datetime | None] = mapped_column(Timestamp)
    completed_at: Mapped[datetime | None] = mapped_column(Timestamp)
    failed_at: Mapped[datetime | None] = mapped_column(Timestamp)
    expired_at: Mapped[datetime | None] = mapped_column(Timestamp)
    cancelling_at: Mapped[datetime | None] = mapped_column(Timestamp)
    cancelled_at: Mapped[datetime | None] = mapped_column(Timestamp)


class BatchLineErrorRow(Base):
    """A batch file line that never became a request (bad JSON, duplicate custom_id, ...), with its reason."""

    __tablename__ = "batch_line_errors"

    batch_job_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("batch_jobs.id", ondelete="CASCADE"), primary_key=True
    )
    line_no: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1-based, as an editor shows it
    custom_id: Mapped[str | None] = mapped_column(KeptText)
    code: Mapped[str] = mapped_column(Text)
    message: Mapped[str] = mapped_column(KeptText)


# NOTE: declared on the existing table from here, so the requests model above stays as migration 0001 wrote it.
# requests.batch_job_id still has no foreign key: tests/store/test_models.py inserts rows naming jobs that
# do not exist; adding it is a one-line migration once that test creates its job first.
Index("ix_requests_tenant_status", RequestRow.tenant, RequestRow.status)


class RunRow(Base):
    """One config served on one workload on one machine: everything needed to trust and repeat the figures."""

    __tablename__ = "runs"
    __table_args__ = (
        Index("ix_runs_workload_fingerprint", "workload_fingerprint"),
        Index("ix_runs_started_at", "started_at"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    serving_config_name: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(Text)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB)
    workload_name: Mapped[str] = mapped_column(Text)
    workload_fingerprint: Mapped[str] = mapped_column(Text)
    workload: Mapped[dict[str, Any]] = mapped_column(JSONB)
    hardware: Mapped[dict[str, Any]] = mapped_column(JSONB)
    software: Mapped[dict[str, Any]] = mapped_column(JSONB)
    worker_name: Mapped[str] = mapped_column(Text)
    plan_name: Mapped[str | None] = mapped_column(Text)
    repeat_index: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    started_at: Mapped[datetime] = mapped_column(Timestamp)
    finished_at: Mapped[datetime] = mapped_column(Timestamp)
    summary: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # NOTE: LAMBADA results with per-passage outcomes, so two runs' quality can be compared paired.
    quality: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))


class RunRequestRow(Base):
    """Which requests a run sent, as which workload item: every stored figure traces back to these."""

    __tablename__ = "run_requests"
    __table_args__ = (Index("ix_run_requests_request_id", "request_id"),)

    run_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    request_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True
    )
    item_index: Mapped[int] = mapped_column(Integer)
    scheduled_offset_ms: Mapped[float | None] = mapped_column(Double)


class ComparisonRow(Base):
    """A plan's verdict: baseline and candidate runs, every figure with its ratio and interval, warnings."""

    __tablename__ = "comparisons"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    plan_name: Mapped[str] = mapped_column(Text)
    plan: Mapped[dict[str, Any]] = mapped_column(JSONB)
    baseline_run_ids: Mapped[list[uuid.UUID]] = mapped_column(ARRAY(UUID(as_uuid=True)))
    candidate_run_ids: Mapped[list[uuid.UUID]] = mapped_column(ARRAY(UUID(as_uuid=True)))
    report: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())


class SweepRow(Base):
    """A batch sweep: throughput and latency against batch size per config, beside the machine's rooflines."""

    __tablename__ = "sweeps"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    report: Mapped[dict[str, Any]] = mapped_column(JSONB)
    hardware: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())


# --- the OpenAI surface (migration 0006) ---


class IdempotencyKeyRow(Base):
    """A tenant's Idempotency-Key: the first submission it came with (endpoint, a digest per body field) and
    what that submission made (a request id or a batch id), so a retry with the key gets that, not a copy."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (Index("ix_idempotency_keys_expires_at", "expires_at"),)

    tenant: Mapped[str] = mapped_column(Text, primary_key=True)
    key: Mapped[str] = mapped_column(Text, primary_key=True)
    endpoint: Mapped[str] = mapped_column(Text)
    body_digest: Mapped[dict[str, str]] = mapped_column(JSONB)
    resource_id: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(Timestamp, server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(Timestamp)

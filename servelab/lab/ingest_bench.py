"""The ingest benchmark: an N-line batch file through the real ingest path, on the local stack's servers.

Runs in a throwaway database (created, migrated, dropped) on the stack's PostgreSQL and under a private key
prefix on its Redis, so a running stack's jobs-worker never sees the bench's job. Four phases, each with
lines/s, this process's CPU, PostgreSQL's CPU (its backends' /proc counters, where the server runs on this
host) and this process's peak resident memory above its level when the phase began: upload (the file
written a part at a time, as the API's upload writes it), ingest (ingest_for, as the jobs-worker's task runs
it, with no back-pressure: no GPU worker drains the queue here), finalise (every request answered first, then
the output and error files written) and download (the output read back a part at a time, as the API serves
it). Imports no torch. Does not parse options or print: the CLI does.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url

from servelab.jobs.ingest import IngestLimits, ingest_for
from servelab.jobs.lifecycle import advance_job
from servelab.queue.streams import RequestStreams
from servelab.embedded import resolve_urls
from servelab.resident import ResidentPeak, return_freed_memory
from servelab.runtime import Runtime, connect
from servelab.settings import Settings
from servelab.store import batch_jobs as jobs
from servelab.store import files
from servelab.store.db import drop_database, session_scope
from servelab.store.models import BatchStatus

TENANT = "bench"
ENDPOINT = "/v1/chat/completions"
BAD_KINDS = ("invalid_json", "invalid_line", "model_not_found", "invalid_request", "duplicate_custom_id")
ANSWER = "The lighthouse keeper counted the ships until the fog lifted and the harbour woke."


@dataclass(frozen=True)
class Phase:
    name: str
    num_lines: int
    seconds: float
    cpu_seconds: float  # this process, every thread
    db_cpu_seconds: float | None  # the bench database's PostgreSQL backends; None where /proc cannot tell
    peak_bytes: int  # resident memory above the phase's start

    @property
    def lines_per_s(self) -> float:
        return self.num_lines / self.seconds

    @property
    def cpu_us_per_line(self) -> float:
        return 1e6 * self.cpu_seconds / self.num_lines

    @property
    def db_us_per_line(self) -> float | None:
        return None if self.db_cpu_seconds is None else 1e6 * self.db_cpu_seconds / self.num_lines


@dataclass(frozen=True)
class BatchFile:
    path: Path
    num_lines: int
    num_bad_lines: int
    num_bytes: int


def write_batch_file(folder: Path, *, num_lines: int, model: str, bad_every: int) -> BatchFile:
    """Chat-completion lines as a real batch has them (a system prompt and a question of a few dozen words);
    every bad_every-th line refused for one reason or another (0: none). Written a line at a time."""
    path, num_bad = folder / "bench.jsonl", 0
    with path.open("wb") as out:
        for i in range(1, num_lines + 1):
            kind = BAD_KINDS[(i // bad_every) % len(BAD_KINDS)] if bad_every and i % bad_every == 0 else None
            num_bad += kind is not None
            out.write(_line(i, model, kind) + b"\n")
    return BatchFile(path, num_lines, num_bad, path.stat().st_size)


def _line(i: int, model: str, kind: str | None) -> bytes:
    question = f"In about {20 + i % 30} words, tell the story of lighthouse number {i} and the ship it saved."
    body = {"model": "no-such-model" if kind == "model_not_found" else model,
            "max_tokens": -1 if kind == "invalid_request" else 16 + i % 16, "temperature": 0,
            "messages": [{"role": "system", "content": "You are a careful storyteller."},
                         {"role": "user", "content": question}]}
    # NOTE: a duplicate repeats the line before it (the same slice, but at a slice's start): a duplicate of a
    # line in an earlier slice makes that slice's COPY run twice, a cost real files rarely pay
    record = {"custom_id": f"req-{i - 1}" if kind == "duplicate_custom_id" else f"req-{i}", "method": "POST",
              "url": ENDPOINT, "body": body}
    if kind == "invalid_line":
        del record["custom_id"]
    line = json.dumps(record).encode()
    return line[:40] if kind == "invalid_json" else line


def _phase_peak() -> ResidentPeak:
    """A phase's peak resident memory. NOTE: garbage collected and freed heap handed back first, else a phase
    reuses what an earlier one freed, and its own peak hides."""
    gc.collect()
    return_freed_memory()
    return ResidentPeak()


def database_cpu_s(runtime: Runtime) -> float | None:
    """CPU seconds of the PostgreSQL backends now serving this runtime's database, read from /proc; None when
    the server is not on this host (or /proc is not readable)."""
    with runtime.db.connect() as conn:
        pids = conn.scalars(text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")).all()
    ticks = os.sysconf("SC_CLK_TCK")
    try:
        return sum(_proc_cpu_ticks(pid) for pid in pids) / ticks
    except (OSError, ValueError, IndexError):
        return None


def _proc_cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


@contextmanager
def measured(runtime: Runtime, name: str, num_lines: int, phases: list[Phase]) -> Iterator[None]:
    """Time a block; its Phase is appended to phases."""
    db_start, cpu_start = database_cpu_s(runtime), time.process_time()
    with _phase_peak() as peak:
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    db_end = database_cpu_s(runtime)
    db = None if db_start is None or db_end is None else max(0.0, db_end - db_start)
    phases.append(Phase(name, num_lines, seconds, cpu, db, peak.above_start_bytes))


def run_ingest_round(runtime: Runtime, batch: BatchFile, *, configs_dir: Path, limits: IngestLimits,
                     streams_for: Callable[[str], RequestStreams]) -> list[Phase]:
    """One file through upload, ingest, finalise and download; every phase checked, not only timed."""
    phases: list[Phase] = []
    with measured(runtime, "upload", batch.num_lines, phases), batch.path.open("rb") as upload:
        with session_scope(runtime.sessions) as session:
            stored = files.create_file(session, tenant=TENANT, purpose="batch", filename=batch.path.name,
                                       content=iter(lambda: upload.read(files.PART_BYTES), b""))
    assert stored.num_bytes == batch.num_bytes, f"uploaded {stored.num_bytes} of {batch.num_bytes} bytes"
    with session_scope(runtime.sessions) as session:
        job = jobs.create_job(session, tenant=TENANT, endpoint=ENDPOINT, input_file_id=stored.id,
                              completion_window="24h", metadata=None, expires_at=datetime.now(UTC) + timedelta(days=1))
    with measured(runtime, "ingest", batch.num_lines, phases):
        ingest_for(sessions=runtime.sessions, streams_for=streams_for, job_id=job.id, configs_dir=configs_dir,
                   worker_live_s=30.0, limits=limits, max_s=3_600.0)
    with session_scope(runtime.sessions) as session:
        counts = jobs.count_requests(session, job=jobs.get_job(session, job_id=job.id))
    assert (counts.total, counts.failed) == (batch.num_lines, batch.num_bad_lines), f"ingest made {counts}"
    answer_every_request(runtime, job.id)
    with measured(runtime, "finalise", batch.num_lines, phases):
        status = advance_job(sessions=runtime.sessions, job_id=job.id, now=datetime.now(UTC))
    assert status is BatchStatus.COMPLETED, f"the job ended {status}"
    with session_scope(runtime.sessions) as session:
        output = files.get_file(session, file_id=jobs.get_job(session, job_id=job.id).output_file_id, tenant=TENANT)
    with measured(runtime, "download", batch.num_lines, phases):
        num_output_lines = _download_lines(runtime, output)
    assert num_output_lines == batch.num_lines - batch.num_bad_lines, f"{num_output_lines} output lines"
    return phases


def answer_every_request(runtime: Runtime, job_id: uuid.UUID) -> None:
    """What the GPU workers would have done: every request of the job succeeded with a short answer.
    NOTE: SQL here, not a store function: only this bench answers requests without serving them."""
    with session_scope(runtime.sessions) as session:
        session.execute(text("""
            WITH answered AS (
                UPDATE requests SET status = 'succeeded', started_at = now(), first_token_at = now(),
                                    finished_at = now(), finish_reason = 'stop', num_attempts = 1
                WHERE batch_job_id = :job_id RETURNING id)
            INSERT INTO results (request_id, text, num_prompt_tokens, num_generated_tokens, token_ids)
            SELECT id, :answer, 40, 16, :token_ids FROM answered
        """), {"job_id": job_id, "answer": ANSWER, "token_ids": list(range(16))})


def _download_lines(runtime: Runtime, found: files.StoredFile) -> int:
    """Read a file back a part at a time, each in a transaction of its own (as the API serves it); -> lines."""
    num_lines = 0
    for offset in range(0, found.num_bytes, files.PART_BYTES):
        with session_scope(runtime.sessions) as session:
            num_lines += files.read_range(session, file_id=found.id, offset=offset, num_bytes=files.PART_BYTES).count(b"\n")
    return num_lines


def run_ingest_bench(runtime: Runtime, *, num_lines: int, model: str, configs_dir: Path, limits: IngestLimits,
                     bad_every: int, num_rounds: int, progress: Callable[[str], None] = lambda _: None
                     ) -> tuple[BatchFile, list[list[Phase]]]:
    """num_rounds rounds of one generated file; -> the file and each round's phases."""
    prefix = runtime.settings.key_prefix

    def streams_for(name: str) -> RequestStreams:
        return RequestStreams(runtime.redis, prefix=prefix, config_name=name)

    with tempfile.TemporaryDirectory(prefix="servelab-bench-ingest-") as folder:
        batch = write_batch_file(Path(folder), num_lines=num_lines, model=model, bad_every=bad_every)
        rounds = []
        for i in range(num_rounds):
            progress(f"round {i + 1} of {num_rounds}: {num_lines} lines")
            rounds.append(run_ingest_round(runtime, batch, configs_dir=configs_dir, limits=limits,
                                           streams_for=streams_for))
    return batch, rounds


@contextmanager
def throwaway_stack(settings: Settings, *, label: str = "ingest") -> Iterator[Runtime]:
    """A Runtime on the stack's servers (embedded ones started where no URL is set) with a database and a
    key prefix of its own (named after the bench's label), both removed afterwards however the block ends."""
    urls = resolve_urls(settings)
    name = f"servelab_bench_{label}_{uuid.uuid4().hex[:12]}"
    database_url = make_url(urls.database_url).set(database=name).render_as_string(hide_password=False)
    prefix = f"{settings.key_prefix}:bench-{label}-{uuid.uuid4().hex[:8]}"
    runtime = connect(settings.model_copy(update={"redis_url": urls.redis_url, "database_url": database_url,
                                                  "key_prefix": prefix}))
    try:
        yield runtime
    finally:
        keys = list(runtime.redis.scan_iter(f"{prefix}:*"))
        if keys:
            runtime.redis.delete(*keys)
        runtime.close()
        drop_database(database_url)


def format_ingest_table(by_round: list[list[Phase]]) -> str:
    """One row per phase: medians over the rounds."""
    rows = [f"{'phase':<9} {'lines/s':>9} {'seconds':>8} {'process CPU us/line':>20} {'PostgreSQL CPU us/line':>23} "
            f"{'peak RSS above start':>21}"]
    for i, name in enumerate(p.name for p in by_round[0]):
        phases = [r[i] for r in by_round]
        db = [p.db_us_per_line for p in phases]
        db_text = "n/a" if None in db else f"{statistics.median(db):.1f}"
        rows.append(f"{name:<9} {statistics.median(p.lines_per_s for p in phases):>9,.0f} "
                    f"{statistics.median(p.seconds for p in phases):>8.2f} "
                    f"{statistics.median(p.cpu_us_per_line for p in phases):>20.1f} {db_text:>23} "
                    f"{statistics.median(p.peak_bytes for p in phases) / 2**20:>17.1f} MiB")
    return "\n".join(rows)

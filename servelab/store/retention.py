"""Store functions of retention: one slice at a time, the rows old enough to go, and only those nothing still needs.

Knows what may go: a finished request (its result, metrics and streamed figures go with it, by the foreign
keys' ON DELETE CASCADE) unless a lab run sent it or its batch job is still running; a batch record once no
request's metrics name it; a file nobody names, or the content of one only finished jobs name. Runs,
comparisons, sweeps and batch jobs are never touched. Takes a session, never commits: the caller commits
each slice, so locks are held for one slice only. Does not know the ages: the caller gives the cutoffs.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, exists, select, union_all, update
from sqlalchemy.orm import Session

from servelab.store.batch_jobs import ACTIVE
from servelab.store.models import (BatchJobRow, BatchRow, FilePartRow, FileRow, RequestMetricsRow, RequestRow,
                                   RequestStatus, RunRequestRow)

FINISHED = (RequestStatus.SUCCEEDED, RequestStatus.FAILED, RequestStatus.CANCELLED)


def delete_old_requests(session: Session, *, cutoff: datetime, after: datetime | None, limit: int
                        ) -> tuple[int, datetime | None]:
    """Delete up to `limit` finished requests enqueued and finished before cutoff, oldest first, from `after`
    on (the enqueue time the last slice reached); -> how many, and where this slice reached.

    NOTE: the age is read through ix_requests_enqueued_at; `after` keeps the rows a run holds (old and never
    deleted) from being read again by every slice. SKIP LOCKED: a row a worker or the api holds waits for the
    next run.
    """
    is_kept = (exists().where(RunRequestRow.request_id == RequestRow.id)
               | exists().where(BatchJobRow.id == RequestRow.batch_job_id, BatchJobRow.status.in_(ACTIVE)))
    doomed = (select(RequestRow.id, RequestRow.enqueued_at)
              .where(RequestRow.enqueued_at < cutoff, RequestRow.finished_at < cutoff,
                     RequestRow.status.in_(FINISHED), ~is_kept,
                     *([RequestRow.enqueued_at >= after] if after is not None else []))
              .order_by(RequestRow.enqueued_at).limit(limit)
              .with_for_update(of=RequestRow, skip_locked=True)).cte("doomed")
    reached = session.execute(delete(RequestRow).where(RequestRow.id.in_(select(doomed.c.id)))
                              .returning(RequestRow.enqueued_at)).scalars().all()
    return len(reached), max(reached, default=after)


def delete_old_batches(session: Session, *, cutoff: datetime, after: datetime | None, limit: int
                       ) -> tuple[int, datetime | None]:
    """Delete up to `limit` batch records finished before cutoff that no request's metrics name (a kept run's
    requests keep theirs); -> how many, and the finish time this slice reached."""
    doomed = (select(BatchRow.id)
              .where(BatchRow.finished_at < cutoff, ~exists().where(RequestMetricsRow.batch_id == BatchRow.id),
                     *([BatchRow.finished_at >= after] if after is not None else []))
              .order_by(BatchRow.finished_at).limit(limit)
              .with_for_update(skip_locked=True)).cte("doomed")
    reached = session.execute(delete(BatchRow).where(BatchRow.id.in_(select(doomed.c.id)))
                              .returning(BatchRow.finished_at)).scalars().all()
    return len(reached), max(reached, default=after)


def delete_old_files(session: Session, *, cutoff: datetime, now: datetime, limit: int) -> int:
    """Files created before cutoff, up to `limit`: deleted where no batch job names them; where only finished
    jobs do, their content erased and the row kept (the job points at it; reads find it gone, as a deleted file).
    Files of running jobs are kept whole. -> files deleted or erased."""
    named = union_all(*(select(column).where(column.is_not(None)) for column in (
        BatchJobRow.input_file_id, BatchJobRow.output_file_id, BatchJobRow.error_file_id))).subquery()
    of_active = union_all(*(select(column).where(column.is_not(None), BatchJobRow.status.in_(ACTIVE)) for column in (
        BatchJobRow.input_file_id, BatchJobRow.output_file_id, BatchJobRow.error_file_id))).subquery()
    unnamed = (select(FileRow.id).where(FileRow.created_at < cutoff, FileRow.id.not_in(select(named.c[0])))
               .limit(limit).with_for_update(skip_locked=True))
    num_deleted = len(session.execute(delete(FileRow).where(FileRow.id.in_(unnamed)).returning(FileRow.id)).all())
    erasable = (select(FileRow.id).where(FileRow.created_at < cutoff, FileRow.deleted_at.is_(None),
                                         FileRow.id.not_in(select(of_active.c[0])))
                .limit(limit - num_deleted).with_for_update(skip_locked=True))
    erased = session.scalars(update(FileRow).where(FileRow.id.in_(erasable)).values(deleted_at=now)
                             .returning(FileRow.id)).all()
    if erased:
        session.execute(delete(FilePartRow).where(FilePartRow.file_id.in_(erased)))  # NOTE: a deleted row's go with it
    return num_deleted + len(erased)

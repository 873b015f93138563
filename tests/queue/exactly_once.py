"""Exactly once, read from what would count above one if a request ran twice (for the fault tests).

Knows where a second run leaves a trace: the started executions on the request row (a conditional claim adds
one per run), the done notifications in Redis (a list: every finish pushes one, recorded or not), the
completions the batch records wrote (num_requests is per record, not unique per request, unlike the results
table whose key is the request id), the stream entries still pending (delivered, never acknowledged) or left
in the streams, and each answer beside the reference decoding of its prompt by the engine alone.
Does not know how the test made its faults.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from servelab.engine.engine import Engine
from servelab.queue.streams import GROUP, RequestStreams, done_key
from servelab.request import GenerationRequest, SamplingParams
from servelab.store.db import session_scope
from servelab.store.models import BatchRow, RequestRow, RequestStatus, ResultRow


@dataclass(frozen=True)
class Ledger:
    statuses: dict[str, RequestStatus]  # by request id, every id asked about that has a row
    attempts: dict[str, int]  # started executions
    errors: dict[str, str | None]
    notified: dict[str, int]  # done notifications pushed for the request
    token_ids: dict[str, tuple[int, ...]]  # the stored answer of each request that has one
    num_recorded: int  # completions written by the config's batch records, all requests together
    num_pending: int  # entries delivered and never acknowledged, both streams
    num_in_streams: int  # entries still in the streams (an acknowledged entry is deleted)
    num_enqueued: int  # ids still marked as in a stream


def read_ledger(*, sessions: sessionmaker[Session], streams: RequestStreams, ids: list[str]) -> Ledger:
    uuids = [uuid.UUID(i) for i in ids]
    with session_scope(sessions) as session:
        rows = session.execute(select(RequestRow.id, RequestRow.status, RequestRow.num_attempts, RequestRow.error)
                               .where(RequestRow.id.in_(uuids))).all()
        results = session.execute(select(ResultRow.request_id, ResultRow.token_ids)
                                  .where(ResultRow.request_id.in_(uuids))).all()
        recorded = session.scalar(select(func.coalesce(func.sum(BatchRow.num_requests), 0))
                                  .where(BatchRow.serving_config_name == streams.config_name))
    client = streams.client
    return Ledger(
        statuses={str(i): status for i, status, _, _ in rows},
        attempts={str(i): attempts for i, _, attempts, _ in rows},
        errors={str(i): error for i, _, _, error in rows},
        notified={i: client.llen(done_key(streams.prefix, i)) for i in ids},
        token_ids={str(i): tuple(t) for i, t in results},
        num_recorded=int(recorded),
        num_pending=sum(client.xpending(key, GROUP)["pending"] for key in streams.keys if client.exists(key)),
        num_in_streams=sum(client.xlen(key) for key in streams.keys),
        num_enqueued=client.scard(streams.enqueued_key),
    )


def assert_each_ran_to_one_end(ledger: Ledger, ids: list[str], *, succeeded: set[str]) -> None:
    """Every id answered once: one end each, notified once, the successes written once, nothing left queued."""
    assert set(ledger.statuses) == set(ids), "a submitted request has no row"
    assert {i for i, s in ledger.statuses.items() if s is RequestStatus.SUCCEEDED} == succeeded
    assert all(s.is_terminal for s in ledger.statuses.values()), ledger.statuses
    assert ledger.notified == dict.fromkeys(ids, 1), "a request was notified done more or less than once"
    assert set(ledger.token_ids) == succeeded
    assert ledger.num_recorded == len(succeeded), "a completion was written more than once (or not at all)"
    assert (ledger.num_pending, ledger.num_in_streams, ledger.num_enqueued) == (0, 0, 0), \
        "a stream entry was left unacknowledged"


def reference_token_ids(engine: Engine, prompts: dict[str, str], *, max_new_tokens: int,
                        ignore_eos: bool = False) -> dict[str, tuple[int, ...]]:
    """Each prompt decoded greedily by the engine alone, outside the serving path, in one closed batch
    (tests/engine checks a batch's tokens against naive uncached decoding of each prompt alone)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    result = engine.generate([GenerationRequest(i, prompt=p, params=params) for i, p in prompts.items()])
    assert all(c.error is None and c.token_ids for c in result.completions), result.completions
    return {c.request_id: c.token_ids for c in result.completions}


def deliveries(streams: RequestStreams) -> dict[str, tuple[str, int]]:
    """Request id -> (the consumer holding its entry, times the entry was delivered), for pending entries."""
    held = {}
    for key in streams.keys:
        if not streams.client.exists(key):
            continue
        ids = {_text(entry_id): _text(fields[b"request_id"]) for entry_id, fields in streams.client.xrange(key)}
        for p in streams.client.xpending_range(key, GROUP, min="-", max="+", count=1000):
            held[ids[_text(p["message_id"])]] = (_text(p["consumer"]), p["times_delivered"])
    return held


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

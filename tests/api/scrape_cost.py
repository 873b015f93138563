"""What a /metrics scrape costs with 1,000 and with 1,000,000 stored requests: a measurement, not a test.

Run: .venv/bin/python -m tests.api.scrape_cost [--small 1000] [--large 1000000] [--prune-s 15]
Fills a throwaway database (created and dropped here, on the tests' PostgreSQL) with finished requests, their
results, metrics and batch records by INSERT ... SELECT generate_series, and times side by side at each size:
GET /metrics of the real app (in-process, its counts filled as a worker's would be), and the query the old
/metrics ran at every scrape (counts by status, tokens, three histograms over every stored request), kept
here for the comparison. Then ages every request past the retention age and lets one retention run delete
for --prune-s seconds: the rate a backlog drains at.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy import text

from api.app import create_app
from servelab.outputs import Completion
from servelab.jobs.retention import RetentionPolicy, prune
from servelab.request import FinishReason
from servelab.runtime import connect
from servelab.settings import ServiceSettings
from servelab.store.db import make_engine, session_factory
from servelab.store.migrate import upgrade
from servelab.telemetry import WorkerMeter, count_submission
from tests.conftest import REDIS_URL, REPO, create_test_database, drop_test_database
from tests.timing import samples_s

FILL = """
CREATE TEMP TABLE seed AS
SELECT g, gen_random_uuid() AS id, now() - make_interval(secs => g) AS t0, g / 8 AS batch_no
FROM generate_series(CAST(:first AS integer), CAST(:last AS integer)) AS g;

CREATE TEMP TABLE seed_batches AS SELECT batch_no, gen_random_uuid() AS id FROM (SELECT DISTINCT batch_no FROM seed) AS d;

INSERT INTO batches (id, worker_name, serving_config_name, config_hash, num_requests, num_rows_per_step, prefill_ms,
                     decode_ms, num_prefill_tokens, num_decode_tokens, device, weight_bytes, kv_cache_bytes,
                     kv_cache_allocated_bytes, peak_working_bytes, peak_process_bytes, started_at, finished_at)
SELECT id, 'w', 'fp32', 'hash', 8, ARRAY[8,8,8,8,8,8,8,8], 10, 100, 160, 56, 'cpu', 500000000, 1000000, 1000000,
       2000000, 600000000, now() - make_interval(secs => batch_no * 8), now() - make_interval(secs => batch_no * 8)
FROM seed_batches;

INSERT INTO requests (id, serving_config_name, stream, status, prompt, enqueued_at, started_at, first_token_at,
                      finished_at, finish_reason, num_attempts)
SELECT id, 'fp32', 'interactive', 'succeeded', 'prompt ' || g, t0, t0 + interval '5 ms', t0 + interval '50 ms',
       t0 + interval '900 ms', 'length', 1
FROM seed;

INSERT INTO results (request_id, text, num_prompt_tokens, num_generated_tokens, token_ids)
SELECT id, 'generated text', 20, 8, ARRAY[1,2,3,4,5,6,7,8] FROM seed;

INSERT INTO request_metrics (request_id, batch_id, queue_ms, ttft_ms, tpot_ms, e2e_ms, itl_ms)
SELECT s.id, b.id, 5, 45, 20, 895, ARRAY[20,21,19,22,20,21,20]::float8[] FROM seed s JOIN seed_batches b USING (batch_no);

DROP TABLE seed;
DROP TABLE seed_batches
"""

# NOTE: what servelab.store.requests.serving_stats ran at every scrape before the counts were made at the event
OLD_SCRAPE = [
    "SELECT status, count(*) FROM requests GROUP BY status",
    "SELECT coalesce(sum(num_generated_tokens), 0) FROM results",
    *(f"SELECT {', '.join(f'count(*) FILTER (WHERE {c} <= {b})' for b in (5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000))}, "
      f"count({c}), coalesce(sum({c}), 0) FROM request_metrics" for c in ("ttft_ms", "tpot_ms", "e2e_ms")),
]


def timed_ms(fn, *, repeats: int) -> str:
    """Median and fastest of `repeats` calls (the fastest is what the call costs on a quiet machine)."""
    samples = samples_s(fn, repeats=repeats)
    return f"{statistics.median(samples) * 1e3:7.1f} / {min(samples) * 1e3:5.1f} ms"


def fill_counts() -> None:
    """What a busy process has counted: three configs, a few hundred finished rows and submissions each."""
    for name in ("fp32", "bf16", "awq-int4"):
        meter = WorkerMeter(name)
        rows = [Completion(str(uuid.uuid4()), "t", tuple(range(8)), 20, FinishReason.LENGTH, ttft_ms=40.0 + i % 50,
                           token_times_ms=tuple(40.0 + i % 50 + 20 * k for k in range(8)), e2e_ms=200.0 + i,
                           started_at_s=time.time()) for i in range(300)]
        meter.finished(rows, enqueued_at={c.request_id: datetime.now(UTC) for c in rows})
        meter.turn(num_prompt_tokens=40, num_cached_tokens=16, num_step_tokens=32, num_generated_tokens=8,
                   num_step_rows=8, num_running=8, num_waiting=2, kv_cache_usage=0.5)
        for outcome in ("accepted", "too_many_queued_requests"):
            count_submission(endpoint="/v1/completions", model_name=name, outcome=outcome)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--prune-s", type=float, default=15.0, help="seconds of retention to time (0: none)")
    args = parser.parse_args()
    url = create_test_database()
    try:
        upgrade(url)
        engine = make_engine(url)
        settings = ServiceSettings(database_url=url.render_as_string(hide_password=False), redis_url=REDIS_URL,
                                   key_prefix=f"servelab-scrape-{uuid.uuid4().hex[:8]}", configs_dir=REPO / "configs")
        runtime = connect(settings, migrate=False)
        client = TestClient(create_app(runtime, settings))
        fill_counts()
        stored = 0
        print(f"{'stored requests':>16}   {'GET /metrics':>18}   {'old scrape query':>18}   "
              f"(median / fastest of {args.repeats})")
        for size in (args.small, args.large):
            started = time.perf_counter()
            with engine.begin() as conn:
                for statement in FILL.split(";\n"):
                    conn.execute(text(statement), {"first": stored, "last": size - 1})
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("VACUUM ANALYZE"))
            filled_s, stored = time.perf_counter() - started, size
            scrape = timed_ms(lambda: client.get("/metrics").raise_for_status(), repeats=args.repeats)
            with engine.connect() as conn:
                old = timed_ms(lambda: [conn.execute(text(q)).all() for q in OLD_SCRAPE], repeats=args.repeats)
            print(f"{size:>16,}   {scrape:>18}   {old:>18}   (filled in {filled_s:.0f} s)")
        if args.prune_s > 0:
            with engine.begin() as conn:  # NOTE: every request and batch record past a one-day retention age
                conn.execute(text("UPDATE requests SET enqueued_at = enqueued_at - interval '400 days', "
                                  "finished_at = finished_at - interval '400 days'"))
                conn.execute(text("UPDATE batches SET finished_at = finished_at - interval '400 days'"))
            policy = RetentionPolicy(max_age=timedelta(days=1), max_file_age=None, budget_s=args.prune_s)
            started = time.perf_counter()
            pruned = prune(sessions=session_factory(engine), policy=policy, now=datetime.now(UTC))
            spent = time.perf_counter() - started
            print(f"retention: {pruned.num_requests:,} requests (with results and metrics) and "
                  f"{pruned.num_batches:,} batch records in {spent:.1f} s: {pruned.num_requests / spent:,.0f} "
                  f"requests/s, 1,000 per transaction; all done: {pruned.is_done}")
            after = timed_ms(lambda: client.get("/metrics").raise_for_status(), repeats=args.repeats)
            print(f"GET /metrics after retention: {after}")
        runtime.close()
        engine.dispose()
    finally:
        drop_test_database(url)


if __name__ == "__main__":
    main()

"""How fast the dashboard's queries are with 100 runs and 100,000 requests: a measurement, not a test.

Run: .venv/bin/python -m tests.dashboard.query_speed [--runs 100] [--requests 100000]
Fills a throwaway database (created and dropped here, on the tests' PostgreSQL) with synthetic rows by
INSERT ... SELECT generate_series (hand-written rows: this measures query speed, not correctness), then
prints the median of 5 timed calls of every query function the pages use, and the verdict computation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime

import redis
from sqlalchemy import text
from sqlalchemy.orm import Session

from servelab.analysis.verdict import compare
from servelab.lab import runsets
from servelab.queue.streams import stream_depths
from servelab.store import queries
from servelab.store.db import make_engine
from servelab.store.migrate import upgrade
from tests.conftest import REDIS_URL, create_test_database, drop_test_database
from tests.timing import samples_s

FILL = """
CREATE TEMP TABLE seed_runs AS
SELECT i, gen_random_uuid() AS id, 'cfg-' || (i % 10) AS config_name, 'fp-' || (i % 5) AS fingerprint
FROM generate_series(0, :num_runs - 1) AS i;

INSERT INTO runs (id, serving_config_name, config_hash, config, workload_name, workload_fingerprint, workload,
                  hardware, software, worker_name, plan_name, repeat_index, started_at, finished_at, summary, quality)
SELECT id, config_name, 'hash-' || (i % 10),
       jsonb_build_object('name', config_name, 'model', 'bundled:smollm2-135m-instruct',
                          'weights', (ARRAY['fp32','bf16','awq-int4'])[1 + i % 3], 'kv_cache_dtype', 'auto',
                          'device', 'cpu', 'num_threads', 2,
                          'batching', jsonb_build_object('max_batch_size', 4, 'max_wait_ms', 20,
                                                         'max_batch_tokens', 16384),
                          'decoding', jsonb_build_object('max_new_tokens', 64, 'max_context_tokens', 2048)),
       'smoke', fingerprint, '{}'::jsonb,
       '{"cpu": "synthetic", "num_cpus": 2, "device": "cpu", "gpu": null}'::jsonb, '{}'::jsonb, 'w', 'plan',
       i / 10 % 2, now() - make_interval(mins => i), now() - make_interval(mins => i) + interval '30 s',
       jsonb_build_object('num_requests', :per_run, 'num_succeeded', :per_run, 'output_tokens_per_s', 100 + i,
                          'requests_per_s', 5, 'goodput_requests_per_s', 5, 'weight_bytes', 500000000,
                          'kv_cache_peak_bytes', 1000000, 'working_peak_bytes', 2000000, 'cost_per_request', 0.001,
                          'cost_per_1k_output_tokens', 0.01,
                          'latency', jsonb_build_object(
                              'ttft_ms', '{"mean": 50, "p50": 40, "p95": 90, "p99": 120, "p95_low": 80, "p95_high": 99}'::jsonb,
                              'tpot_ms', '{"mean": 20, "p50": 19, "p95": 25, "p99": 30, "p95_low": 24, "p95_high": 26}'::jsonb,
                              'e2el_ms', '{"mean": 900, "p50": 850, "p95": 1200, "p99": 1500, "p95_low": 1100, "p95_high": 1300}'::jsonb)),
       jsonb_build_object('task', 'lambada', 'accuracy', jsonb_build_object('value', 0.3, 'low', 0.25, 'high', 0.35),
                          'passage_ids', (SELECT jsonb_agg(p) FROM generate_series(0, 199) p),
                          'correct', (SELECT jsonb_agg((p + i) % 3 = 0)::jsonb FROM generate_series(0, 199) p),
                          'nll', (SELECT jsonb_agg(1.5) FROM generate_series(0, 199) p),
                          'num_target_tokens', (SELECT jsonb_agg(1) FROM generate_series(0, 199) p))
FROM seed_runs;
UPDATE runs SET quality = jsonb_set(quality, '{correct}',
    (SELECT jsonb_agg(CASE WHEN value::text = 'true' THEN 1 ELSE 0 END) FROM jsonb_array_elements(quality->'correct')));

CREATE TEMP TABLE seed_requests AS
SELECT g, gen_random_uuid() AS id, r.id AS run_id, r.config_name, (g % :per_run) AS item,
       ((g / 4)) AS batch_no, now() - make_interval(secs => g) AS t0
FROM generate_series(0, :num_requests - 1) AS g JOIN seed_runs r ON r.i = g / :per_run;

CREATE TEMP TABLE seed_batches AS
SELECT batch_no, gen_random_uuid() AS id FROM (SELECT DISTINCT batch_no FROM seed_requests) AS d;

INSERT INTO batches (id, worker_name, serving_config_name, config_hash, num_requests, num_rows_per_step, prefill_ms,
                     decode_ms, num_prefill_tokens, num_decode_tokens, device, weight_bytes, kv_cache_bytes,
                     kv_cache_allocated_bytes, peak_working_bytes, peak_process_bytes, started_at, finished_at)
SELECT b.id, 'w', 'cfg', 'hash', 4, ARRAY[4,4,4,4,4,4,4,4], 10, 100, 4 * 20, 28, 'cpu', 500000000,
       4 * 27 * 23040, 4 * 27 * 23040, 2000000, 600000000, now(), now()
FROM seed_batches b;

INSERT INTO requests (id, serving_config_name, stream, status, prompt, enqueued_at, started_at, first_token_at,
                      finished_at, finish_reason, num_attempts, error, batch_job_id)
SELECT id, config_name, 'interactive', CASE WHEN g % 100 = 0 THEN 'failed' ELSE 'succeeded' END::request_status,
       'prompt ' || g, t0, t0 + interval '5 ms', t0 + interval '50 ms', t0 + interval '900 ms',
       CASE WHEN g % 100 = 0 THEN 'error' ELSE 'length' END::finish_reason, 1,
       CASE WHEN g % 100 = 0 THEN 'synthetic failure' END, NULL
FROM seed_requests;

INSERT INTO results (request_id, text, num_prompt_tokens, num_generated_tokens, token_ids)
SELECT id, 'generated text', 20, 8, ARRAY[1,2,3,4,5,6,7,8] FROM seed_requests WHERE g % 100 <> 0;

INSERT INTO request_metrics (request_id, batch_id, queue_ms, ttft_ms, tpot_ms, e2e_ms, itl_ms)
SELECT r.id, b.id, 5, 45, 20 + (r.g % 7), 895, ARRAY[20,21,19,22,20,21,20]::float8[]
FROM seed_requests r JOIN seed_batches b USING (batch_no);

INSERT INTO run_requests (run_id, request_id, item_index, scheduled_offset_ms)
SELECT run_id, id, item, NULL FROM seed_requests;

INSERT INTO comparisons (id, plan_name, plan, baseline_run_ids, candidate_run_ids, report)
SELECT gen_random_uuid(), 'plan', '{}'::jsonb, ARRAY[(SELECT id FROM seed_runs WHERE i = 0)],
       ARRAY[(SELECT id FROM seed_runs WHERE i = 1)], '{}'::jsonb;

INSERT INTO workers (name, serving_config_name, config_hash, hardware, software)
SELECT 'worker-' || i, 'cfg-' || i, 'hash', '{"device": "cpu", "cpu": "synthetic", "num_cpus": 2}', '{}'
FROM generate_series(0, 9) AS i;
"""


def timed(fn, *, repeats: int = 5) -> float:
    return statistics.median(samples_s(fn, repeats=repeats)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args()
    per_run = args.requests // args.runs
    url = create_test_database()
    try:
        upgrade(url)
        engine = make_engine(url)
        started = time.perf_counter()
        with engine.begin() as conn:
            for statement in FILL.split(";\n"):
                if statement.strip():
                    conn.execute(text(statement), {"num_runs": args.runs, "num_requests": per_run * args.runs,
                                                   "per_run": per_run})
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE"))
        print(f"filled {args.runs} runs, {per_run * args.runs} requests in {time.perf_counter() - started:.1f} s")
        client = redis.Redis.from_url(REDIS_URL)
        with Session(engine) as s:
            listing = queries.list_runs(s)
            groups: dict[tuple[str, str], list[str]] = {}
            for r in listing:
                groups.setdefault((r.workload_fingerprint, r.serving_config_name), []).append(r.id)
            (fp, _), base = next(iter(groups.items()))
            cand = next(ids for (f, _), ids in groups.items() if f == fp and ids != base)
            base_set, cand_set = runsets.load_run_set(s, run_ids=base), runsets.load_run_set(s, run_ids=cand)
            rows = [
                ("list_runs (all runs)", lambda: queries.list_runs(s)),
                (f"load_run_set ({len(base)} runs, {len(base) * per_run} requests)",
                 lambda: runsets.load_run_set(s, run_ids=base)),
                ("stored_limits", lambda: runsets.stored_limits(s, baseline_run_ids=base, candidate_run_ids=cand)),
                ("latest_comparison_runs", lambda: queries.latest_comparison_runs(s)),
                (f"batch_points ({len(base)} runs)", lambda: queries.batch_points(s, run_ids=base)),
                ("request_tokens (1 run)", lambda: queries.request_tokens(s, run_ids=base[:1])),
                ("list_sweeps", lambda: queries.list_sweeps(s)),
                ("job_progress", lambda: queries.job_progress(s)),
                ("request_status_counts (every request)", lambda: queries.request_status_counts(s)),
                ("unfinished_config_names", lambda: queries.unfinished_config_names(s)),
                ("workers", lambda: queries.workers(s, now=datetime.now(UTC))),
                ("recent_failures", lambda: queries.recent_failures(s)),
                ("stream_depths (Redis, 10 configs)",
                 lambda: stream_depths(client, prefix="servelab-speed", config_names=[f"cfg-{i}" for i in range(10)])),
                (f"compare() verdict, not a query ({len(base_set.pooled())} vs {len(cand_set.pooled())} requests)",
                 lambda: compare(base_set, cand_set, runsets.DEFAULT_LIMITS)),
            ]
            for name, fn in rows:
                print(f"{timed(fn):9.1f} ms  {name}")
        client.close()
        engine.dispose()
    finally:
        drop_test_database(url)


if __name__ == "__main__":
    main()

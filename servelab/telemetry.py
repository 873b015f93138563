"""The Prometheus metrics servelab's processes keep, observed where the events happen: the worker counts a
step, a preemption and a finished row as it serves them; the api counts a submission as it answers it.

Knows the names, labels and buckets (vLLM's names under servelab's prefix: `servelab:time_to_first_token_seconds
{model_name="fp32"}`), the arithmetic from a Completion to its observations, and how a process exports them:
alone (counts in memory), or as one of several api processes behind one port (counts in files of a shared
folder, prometheus_client's multiprocess mode, summed at each scrape). Does not know PostgreSQL or Redis: a
scrape reads counts already made, so it costs the same whatever history is stored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest, start_http_server, values)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from servelab.outputs import BatchTimings, Completion
from servelab.request import FinishReason

log = logging.getLogger(__name__)
PREFIX = "servelab:"
REGISTRY = CollectorRegistry(auto_describe=True)
# NOTE: `_created` series double the series and no dashboard reads them; a flag of the library, read at each scrape
disable_created_metrics()

# Seconds. TTFT as vLLM's; E2E and queue time go past vLLM's two hours to a day: a bulk job may wait its window.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 3600.0, 7680.0, 14400.0, 28800.0, 86400.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class MetricSpec:
    """One exported family: its name as written, Prometheus type and labels (what a dashboard may query)."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    labels: tuple[str, ...]

    @property
    def sample_names(self) -> tuple[str, ...]:
        return {"counter": (f"{self.name}_total",), "gauge": (self.name,),
                "histogram": (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")}[self.kind]


SPECS: dict[str, MetricSpec] = {}  # every family a process of servelab exports, by name
_KEPT: list[Counter | Gauge | Histogram] = []  # the ones kept in this module (not read at scrape time)


def _spec(kind: str, name: str, labels: Sequence[str]) -> str:
    SPECS[PREFIX + name] = MetricSpec(PREFIX + name, kind, tuple(labels))
    return PREFIX + name


def _kept(metric):
    _KEPT.append(metric)
    return metric


def _counter(name: str, doc: str, labels: Sequence[str] = ("model_name",)) -> Counter:
    return _kept(Counter(_spec("counter", name, labels), doc, labels, registry=REGISTRY))


def _gauge(name: str, doc: str, labels: Sequence[str] = ("model_name",)) -> Gauge:
    return _kept(Gauge(_spec("gauge", name, labels), doc, labels, registry=REGISTRY, multiprocess_mode="mostrecent"))


def _histogram(name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ("model_name",)) -> Histogram:
    return _kept(Histogram(_spec("histogram", name, labels), doc, labels, registry=REGISTRY, buckets=buckets))


# --- the worker: one process per config and device, its own /metrics port ---
RUNNING = _gauge("num_requests_running", "Rows in the engine's batch after the last step.")
WAITING = _gauge("num_requests_waiting", "Requests this worker holds (read from the stream), not started yet.")
KV_CACHE_USAGE = _gauge("kv_cache_usage_perc", "KV room the running rows hold (1 = 100 %): the paged pool's blocks in "
                        "use over its blocks; without a pool, rows x (longest prompt + max_new_tokens) over "
                        "max_batch_tokens / max_kv_cache_mib.")
PREEMPTIONS = _counter("num_preemptions", "Rows taken out of the batch unfinished, by cause: priority (an interactive "
                       "request took the room) or pool (the KV pool ran out mid-decode); each recomputes its tokens "
                       "when it returns.", ("model_name", "cause"))
THREADS = _gauge("num_threads", "Threads in the worker's compute team after the last step: every core of its share, "
                 "fewer while other processes on the host take some (the worker shrinks its team then, threads.py).")
PROMPT_TOKENS = _counter("prompt_tokens", "Prompt tokens of the requests admitted, once each (computed + cached).")
PROMPT_TOKENS_BY_SOURCE = _counter("prompt_tokens_by_source", "Prompt tokens of the requests admitted, by source: "
                                   "computed (prefilled) or cached (found in the prefix cache).",
                                   ("model_name", "source"))
PROMPT_TOKENS_RECOMPUTED = _counter("prompt_tokens_recomputed", "Tokens computed again because a preemption threw "
                                    "their keys and values away (a row's prompt and the tokens it had generated).")
GENERATION_TOKENS = _counter("generation_tokens", "Tokens generated, counted at the step that made them.")
# NOTE: vLLM's prefix_cache_queries / prefix_cache_hits, in tokens: the hit rate is rate(hits) / rate(queries);
# a worker whose engine looks nothing up (prefix caching off, transformers' decoder) counts 0 queries: no rate
PREFIX_CACHE_QUERIES = _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
PREFIX_CACHE_HITS = _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).")
FINISHED = _counter("request_success", "Requests that finished, by finish reason (stop, length, error, cancelled; "
                    "as vLLM's counts its aborted ones).", ("model_name", "finished_reason"))
STEP_TOKENS = _histogram("iteration_tokens_total", "Tokens per engine step: the prompt tokens it computed and the "
                         "tokens it generated (vLLM's).", STEP_TOKEN_BUCKETS)
STEP_ROWS = _histogram("num_rows_per_step", "Rows in each decode step (the batch size).", ROW_BUCKETS)
REQUEST_PROMPT_TOKENS = _histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                   TOKEN_COUNT_BUCKETS)
REQUEST_GENERATION_TOKENS = _histogram("request_generation_tokens", "Tokens generated for each finished request.",
                                       TOKEN_COUNT_BUCKETS)
TTFT = _histogram("time_to_first_token_seconds", "From enqueue to the first generated token.", TTFT_BUCKETS_S)
ITL = _histogram("inter_token_latency_seconds", "Gap between consecutive generated tokens (one per gap).",
                 TOKEN_GAP_BUCKETS_S)
TPOT = _histogram("request_time_per_output_token_seconds", "Mean gap between generated tokens, one per request.",
                  TOKEN_GAP_BUCKETS_S)
E2E = _histogram("e2e_request_latency_seconds", "From enqueue to the last generated token.", REQUEST_BUCKETS_S)
QUEUE_TIME = _histogram("request_queue_time_seconds", "From enqueue to the start of the request's (last) prefill.",
                        REQUEST_BUCKETS_S)

# --- the api: one or several processes behind one port ---
SUBMISSIONS = _counter("submissions", "Submissions the api answered, by endpoint and outcome (accepted, replayed, "
                       "or the error code).", ("model_name", "endpoint", "outcome"))
STREAMED_TTFT = _histogram("streamed_time_to_first_token_seconds", "From the request's arrival at the api to the "
                           "first text its streaming client was sent.", TTFT_BUCKETS_S)
# read at scrape time from Redis (XLEN / XPENDING), never stored: api/operations.py's collector
QUEUE_DEPTH = _spec("gauge", "queue_depth", ("model_name", "stream"))
FINISHED_NORMALLY = (FinishReason.STOP, FinishReason.LENGTH)


# --- the arithmetic: a finished row's observations ---

@dataclass(frozen=True)
class RequestTimes:
    """A finished row's latencies in seconds, counted from its enqueue as a client counts them."""

    queue_s: float
    ttft_s: float
    e2e_s: float
    tpot_s: float | None
    itl_s: tuple[float, ...]

    @classmethod
    def of(cls, c: Completion, *, enqueued_at_s: float) -> RequestTimes:
        """NOTE: the engine counts from the row's prefill; the wait before it (stream, window, a preemption's
        restart) is added, as request_metrics.queue_ms stores it. The enqueue time is PostgreSQL's clock."""
        assert c.ttft_ms is not None and c.e2e_ms is not None, f"{c.request_id}: no tokens, no latencies"
        queue_s = max(0.0, (c.started_at_s or enqueued_at_s) - enqueued_at_s)
        return cls(queue_s, queue_s + c.ttft_ms / 1e3, queue_s + c.e2e_ms / 1e3,
                   None if c.tpot_ms is None else c.tpot_ms / 1e3, tuple(gap / 1e3 for gap in c.itl_ms))


class WorkerMeter:
    """The observations of one worker's loop, for the config it serves."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        labelled = (RUNNING, WAITING, KV_CACHE_USAGE, PROMPT_TOKENS_RECOMPUTED, PROMPT_TOKENS, GENERATION_TOKENS, STEP_TOKENS,
                    STEP_ROWS, REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS, TTFT, ITL, TPOT, E2E, QUEUE_TIME,
                    PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS)
        # NOTE: children bound once: an observation is then a lock and an add, no label look-up
        (self.running, self.waiting, self.kv_usage, self.prompt_recomputed, self.prompt_tokens, self.generation_tokens,
         self.step_tokens, self.step_rows, self.request_prompt_tokens, self.request_generation_tokens, self.ttft,
         self.itl, self.tpot, self.e2e, self.queue_time, self.prefix_queries, self.prefix_hits) = (
            m.labels(model_name) for m in labelled)
        self.prompt_computed = PROMPT_TOKENS_BY_SOURCE.labels(model_name, "computed")
        self.prompt_cached = PROMPT_TOKENS_BY_SOURCE.labels(model_name, "cached")

    def turn(self, *, num_prompt_tokens: int, num_cached_tokens: int, num_step_tokens: int, num_generated_tokens: int,
             num_step_rows: int, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """One engine turn: the prompt tokens of the requests admitted for the first time (num_cached_tokens of them
        found in the prefix cache), the tokens the step computed (num_step_tokens) and generated, its rows."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_computed.inc(num_prompt_tokens - num_cached_tokens)
        self.prompt_cached.inc(num_cached_tokens)
        self.generation_tokens.inc(num_generated_tokens)
        if num_step_tokens:
            self.step_tokens.observe(num_step_tokens)
        if num_step_rows:
            self.step_rows.observe(num_step_rows)
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_cache_usage)

    def threads(self, num_threads: int) -> None:
        THREADS.labels(self.model_name).set(num_threads)

    def preempted(self, *, cause: str, num_lost_tokens: int) -> None:
        """A row preempted, and the computed tokens it lost (computed again when it returns)."""
        PREEMPTIONS.labels(self.model_name, cause).inc()
        self.prompt_recomputed.inc(num_lost_tokens)

    def stretch(self, timings: BatchTimings) -> None:
        """The engine's figures of a stretch of steps (what take_stats hands over, once): its prefix-cache
        look-ups and hits, in tokens."""
        self.prefix_queries.inc(timings.num_prefix_query_tokens)
        self.prefix_hits.inc(timings.num_prefix_hit_tokens)

    def finished(self, completions: Iterable[Completion], *, enqueued_at: dict[str, datetime]) -> None:
        """Rows whose result is committed: counted by reason; those that ended normally also by their latencies."""
        for c in completions:
            FINISHED.labels(self.model_name, c.finish_reason.value).inc()
            if c.finish_reason not in FINISHED_NORMALLY or c.ttft_ms is None:
                continue
            times = RequestTimes.of(c, enqueued_at_s=enqueued_at[c.request_id].timestamp())
            self.queue_time.observe(times.queue_s)
            self.ttft.observe(times.ttft_s)
            self.e2e.observe(times.e2e_s)
            if times.tpot_s is not None:
                self.tpot.observe(times.tpot_s)
            for gap in times.itl_s:
                self.itl.observe(gap)
            self.request_prompt_tokens.observe(c.num_prompt_tokens)
            self.request_generation_tokens.observe(c.num_generated_tokens)

    def failed(self, num_requests: int) -> None:
        """Requests failed before the engine saw them (unreadable, or crashed their worker too often)."""
        if num_requests:
            FINISHED.labels(self.model_name, FinishReason.ERROR.value).inc(num_requests)


# --- the api's observations ---

def count_submission(*, endpoint: str, model_name: str, outcome: str) -> None:
    """model_name: a served config's name, or "" where the body named none that exists (bounded labels)."""
    SUBMISSIONS.labels(model_name, endpoint, outcome).inc()


def observe_streamed_ttft(*, model_name: str, ttft_ms: float | None) -> None:
    if ttft_ms is not None:
        STREAMED_TTFT.labels(model_name).observe(ttft_ms / 1e3)


# --- how a process exports ---

_files: dict[str, Path] = {}  # "dir": the folder this process records into, in multiprocess mode


def prepare_files_dir(directory: Path) -> Path:
    """Empty (or create) the folder several api processes will share; the process that starts them calls this
    once, before any of them starts. NOTE: counts left from an earlier run would be summed into this one's."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()
    return directory


def record_in_files(directory: Path) -> None:
    """From now on this process records into `directory` (one file per process and kind), beside the other
    processes that share it; each scrape sums them. Called at a process's entry point, before it counts anything.

    NOTE: prometheus_client picks its value class once, from PROMETHEUS_MULTIPROC_DIR at import; a process that
    learns the folder from its Settings switches it here, before a labelled child (and so a value) exists.
    """
    assert not _observed(), "record_in_files comes before the first observation"
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)  # NOTE: the library reads the folder from here
    if not getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.MultiProcessValue()
    _files["dir"] = directory


def release_process() -> None:
    """At a clean exit: this process's live gauges stop counting (its counters stay in the sum)."""
    if "dir" in _files:
        mark_process_dead(os.getpid(), str(_files["dir"]))


def is_recording_in_files() -> bool:
    return "dir" in _files


def exposition() -> bytes:
    """The text format of every count this process (or, in files, every process sharing the folder) made."""
    if "dir" not in _files:
        return generate_latest(REGISTRY)
    merged = CollectorRegistry(auto_describe=False)
    MultiProcessCollector(merged, path=str(_files["dir"]))
    return generate_latest(merged)


def serve_worker_metrics(port: int, *, max_tries: int = 16) -> int | None:
    """Serve /metrics on `port` (0: none), or the next free one of max_tries (several workers on one host);
    -> the port, None when none was free. A daemon thread: it ends with the process."""
    if port == 0:
        return None
    for candidate in range(port, port + max_tries):
        try:
            start_http_server(candidate, registry=REGISTRY)
        except OSError:
            continue
        return candidate
    log.warning("no free port for /metrics in %d-%d; this worker exports no metrics", port, port + max_tries - 1)
    return None


def _observed() -> bool:
    """Whether a labelled child (a value of the class in use) exists. NOTE: `_metrics` is the library's own table."""
    return any(metric._metrics for metric in _KEPT)

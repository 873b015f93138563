"""Head-of-line benchmark: interactive calls alone and behind a bulk job, per admission policy; and what
streaming costs a batch.

One engine serves every policy in turn (a worker per policy on a private stream, one at a time), so only
the policy differs. Per round and policy: interactive calls sent one after another on an idle worker
(alone), then a bulk job enqueued at once with interactive calls sent at a fixed interval while it runs
(during). Everything goes through the real queue: commit + XADD, the worker, the store, and the request's
token stream, read as a streaming client's relay reads it (time to the first text = streamed TTFT; its end
event = end-to-end). Policies are interleaved round after round, since only figures measured close
together on a shared machine compare. `run_stream_overhead` times one batch with every row streamed against
the same batch with none, interleaved. Does not parse options or print: the CLI does.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from servelab.engine.engine import Engine
from servelab.lab.relays import read_all
from servelab.lab.bench import bench_requests, nearest_rank as percentile
from servelab.scheduler.policy import BatchPolicy
from servelab.queue.streams import RequestStreams, wait_done
from servelab.queue.tokens import read_to_end
from servelab.queue.submit import submit_request
from servelab.request import GenerationRequest, SamplingParams
from servelab.runtime import Runtime
from servelab.serving import FaultPolicy, ServingWorker
from servelab.store import requests as store
from servelab.store.db import session_scope
from servelab.store.models import StreamKind

INTERACTIVE_PROMPT = "What is the capital of France?"


@dataclass(frozen=True)
class HolWorkload:
    num_bulk: int = 48
    bulk_prompt_tokens: int = 64
    bulk_new_tokens: int = 200
    num_interactive: int = 8
    interactive_new_tokens: int = 8
    interval_s: float = 2.0  # between interactive calls during the bulk job


@dataclass(frozen=True)
class HolRound:
    policy: str
    alone_ms: tuple[float, ...]  # each interactive call's end-to-end time, idle worker
    during_ms: tuple[float, ...]  # the same calls while the bulk job runs
    alone_ttft_ms: tuple[float, ...]  # each call's streamed TTFT: submit to its first text in its token stream
    during_ttft_ms: tuple[float, ...]
    bulk_tokens: int
    bulk_wall_s: float
    num_preempted: int

    @property
    def bulk_tokens_per_s(self) -> float:
        return self.bulk_tokens / self.bulk_wall_s


def run_head_of_line(engine: Engine, runtime: Runtime, policies: dict[str, BatchPolicy], workload: HolWorkload,
                     *, num_rounds: int, progress=lambda message: None) -> dict[str, list[HolRound]]:
    bulk = bench_requests(engine, workload.num_bulk, workload.bulk_prompt_tokens, workload.bulk_new_tokens)
    interactive = GenerationRequest("interactive", prompt=INTERACTIVE_PROMPT,
                                    params=SamplingParams(max_new_tokens=workload.interactive_new_tokens,
                                                          ignore_eos=True))
    engine.generate([interactive])  # warm-up
    rounds: dict[str, list[HolRound]] = {name: [] for name in policies}
    for round_idx in range(num_rounds):
        for name, policy in policies.items():
            progress(f"round {round_idx + 1}/{num_rounds}: {name}")
            rounds[name].append(_one_round(engine, runtime, name, policy, bulk, interactive, workload))
    return rounds


def _one_round(engine: Engine, runtime: Runtime, name: str, policy: BatchPolicy, bulk: list[GenerationRequest],
               interactive: GenerationRequest, workload: HolWorkload) -> HolRound:
    settings = runtime.settings
    streams = RequestStreams(runtime.redis, prefix=settings.key_prefix, config_name=f"hol-{uuid.uuid4().hex[:8]}")
    worker = ServingWorker(engine=engine, streams=streams, sessions=runtime.sessions, name=f"hol-{name}",
                           policy=policy, faults=FaultPolicy.from_settings(settings))
    streams.ensure_groups()
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        alone = [_call(worker, interactive, StreamKind.INTERACTIVE) for _ in range(workload.num_interactive)]
        started = time.perf_counter()
        bulk_ids = _submit_job(worker, bulk)
        with ThreadPoolExecutor(max_workers=workload.num_interactive) as pool:
            calls = []
            for i in range(workload.num_interactive):
                time.sleep(workload.interval_s if i else min(1.0, workload.interval_s))
                calls.append(pool.submit(_call, worker, interactive, StreamKind.INTERACTIVE))
            during = [c.result() for c in calls]
        for request_id in bulk_ids:
            assert wait_done(streams.client, prefix=streams.prefix, request_id=request_id, timeout_s=3600)
        bulk_wall_s = time.perf_counter() - started
    finally:
        worker.stop.set()
        thread.join(timeout=120)
    with session_scope(runtime.sessions) as session:
        bulk_tokens = store.count_generated_tokens(session, ids=bulk_ids)
        num_preempted = store.count_preempted(session, ids=bulk_ids)
    return HolRound(name, tuple(e2e for e2e, _ in alone), tuple(e2e for e2e, _ in during),
                    tuple(ttft for _, ttft in alone), tuple(ttft for _, ttft in during), bulk_tokens, bulk_wall_s,
                    num_preempted)


@dataclass(frozen=True)
class JoinCost:
    """What a newcomer's prefill costs the rows already decoding: it runs between two of their steps."""

    num_rows: int
    num_prompt_tokens: int
    step_ms: float  # one decode step of the running rows
    prefill_ms: float  # what one newcomer's prompt adds to the step it joins (that step's time less a plain one's)
    alone_step_ms: float  # one decode step of one row: what a call pays per token alone

    @property
    def tpot_factor(self) -> float:
        """The running rows' time for the token after a join, over a plain step."""
        return (self.step_ms + self.prefill_ms) / self.step_ms


def time_join_cost(engine: Engine, *, num_rows: int, num_prompt_tokens: int, num_rounds: int = 7) -> JoinCost:
    """Medians over interleaved rounds of a plain decode step and of what one newcomer's prompt adds to the step it
    joins, with num_rows running (each round's newcomer leaves after its first token: max_new_tokens 1); and of a lone
    row's step."""
    running = bench_requests(engine, num_rows, num_prompt_tokens, 6 * num_rounds + 8)
    newcomer = bench_requests(engine, 1, num_prompt_tokens, 1)[0]
    engine.take_stats()
    engine.add(running[:1])
    alone = []
    for _ in range(num_rounds):
        started = time.perf_counter()
        engine.step()
        alone.append((time.perf_counter() - started) * 1e3)
    engine.cancel(engine.live_request_ids)
    engine.add(running)
    steps, prefills = [], []
    for i in range(num_rounds):
        started = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - started) * 1e3)
        # NOTE: a newcomer's prompt is computed in the next step, beside the running rows' tokens: its cost is that
        # step's time less a plain one's
        engine.add([GenerationRequest(f"join-{i}", prompt=newcomer.prompt, params=newcomer.params)])
        started = time.perf_counter()
        engine.step()
        prefills.append((time.perf_counter() - started) * 1e3 - steps[-1])
    while engine.num_live:
        engine.step()
    engine.take_stats()
    return JoinCost(num_rows, num_prompt_tokens, statistics.median(steps), statistics.median(prefills),
                    statistics.median(alone))


def _submit(worker: ServingWorker, request: GenerationRequest, kind: StreamKind) -> str:
    return submit_request(sessions=worker.sessions, streams=worker.streams, kind=kind, prompt=request.prompt,
                          sampling=request.params)


def _submit_job(worker: ServingWorker, requests: list[GenerationRequest]) -> list[str]:
    """A bulk job as the jobs feed hands it to the queue: every row committed in one transaction, then every id onto
    the bulk stream in one round trip. NOTE: submitted one by one, a 20 ms window would close while the job is still
    arriving and split it into batches by chance, and the interactive calls' wait would measure that race."""
    with session_scope(worker.sessions) as session:
        ids = [store.create_request(session, serving_config_name=worker.streams.config_name, stream=StreamKind.BULK,
                                    prompt=r.prompt, sampling=r.params) for r in requests]
    worker.streams.enqueue_many(ids, StreamKind.BULK)
    return ids


def _call(worker: ServingWorker, request: GenerationRequest, kind: StreamKind) -> tuple[float, float]:
    """One call as a streaming client sees it: submit, read its token stream to the end; -> (end-to-end ms,
    streamed TTFT ms)."""
    sent = time.perf_counter()
    first_text, end = read_to_end(worker.streams.client, prefix=worker.streams.prefix,
                                  request_id=_submit(worker, request, kind))
    return (end - sent) * 1e3, (first_text - sent) * 1e3


def format_head_of_line(rounds: dict[str, list[HolRound]]) -> str:
    """Per policy, medians over rounds: interactive p50 / p95 alone and during the bulk job, their ratio,
    and the bulk job's tokens/s; then every policy against the first."""
    def median(name: str, what) -> float:
        return statistics.median(what(r) for r in rounds[name])

    lines = [f"{'policy':<12} {'alone p50':>9} {'p95':>7} {'during p50':>10} {'p95':>8} {'p95 x':>7} "
             f"{'TTFT during p50':>15} {'p95':>7} {'bulk tok/s':>10} {'preempted':>9}"]
    for name in rounds:
        a50, a95 = median(name, lambda r: percentile(r.alone_ms, 50)), median(name, lambda r: percentile(r.alone_ms, 95))
        d50, d95 = median(name, lambda r: percentile(r.during_ms, 50)), median(name, lambda r: percentile(r.during_ms, 95))
        t50 = median(name, lambda r: percentile(r.during_ttft_ms, 50))
        t95 = median(name, lambda r: percentile(r.during_ttft_ms, 95))
        lines.append(f"{name:<12} {a50:>7.0f}ms {a95:>5.0f}ms {d50:>8.0f}ms {d95:>6.0f}ms {d95 / a95:>6.1f}x "
                     f"{t50:>13.0f}ms {t95:>5.0f}ms {median(name, lambda r: r.bulk_tokens_per_s):>10.1f} "
                     f"{median(name, lambda r: float(r.num_preempted)):>9.0f}")
    names = list(rounds)
    if len(names) > 1:
        base = names[0]
        for name in names[1:]:
            p95 = median(name, lambda r: percentile(r.during_ms, 95)) / median(base, lambda r: percentile(r.during_ms, 95))
            tps = median(name, lambda r: r.bulk_tokens_per_s) / median(base, lambda r: r.bulk_tokens_per_s)
            lines.append(f"{name} against {base}: interactive p95 during the bulk job x{p95:.3f}, "
                         f"bulk tokens/s x{tps:.3f}")
    lines.append("p95 x = interactive p95 during the bulk job / alone (medians over rounds); TTFT = submit to the "
                 "first text in the call's token stream, as a streaming client's relay reads it")
    return "\n".join(lines)


@dataclass(frozen=True)
class StreamOverhead:
    """One batch's decode with every row streamed and with none, interleaved round after round."""

    num_rows: int
    new_tokens: int
    streamed_tokens_per_s: tuple[float, ...]
    unstreamed_tokens_per_s: tuple[float, ...]
    publish_ms_per_step: float  # the worker's time in publish_step per step, streamed rounds
    step_ms: float  # a turn of the worker's loop, streamed rounds: wall time / new tokens

    @property
    def ratio(self) -> float:
        """Median over rounds of streamed / unstreamed tokens/s, each round's pair measured back to back."""
        return statistics.median(s / u for s, u in zip(self.streamed_tokens_per_s, self.unstreamed_tokens_per_s))


def run_stream_overhead(engine: Engine, runtime: Runtime, *, num_rows: int = 16, prompt_tokens: int = 32,
                        new_tokens: int = 128, num_rounds: int = 3, progress=lambda message: None) -> StreamOverhead:
    """tokens/s of a batch of num_rows interactive requests through the queue, their text published each step
    and read by a relay thread per row (as the API reads it), against the same batch published by no row."""
    requests = bench_requests(engine, num_rows, prompt_tokens, new_tokens)
    policy = BatchPolicy(max_batch_size=num_rows, max_wait_ms=2_000, max_batch_tokens=10**9)
    streamed, unstreamed, publish_s, num_publishes, wall_s = [], [], 0.0, 0, 0.0
    for round_idx in range(num_rounds):
        for kinds, out in ((frozenset({StreamKind.INTERACTIVE}), streamed), (frozenset(), unstreamed)):
            progress(f"round {round_idx + 1}/{num_rounds}: {'every row' if kinds else 'no row'} streamed")
            tokens, seconds, worker = _serve_batch(engine, runtime, requests, policy, kinds)
            out.append(tokens / seconds)
            if kinds:
                publish_s, num_publishes = publish_s + worker.publish_s, num_publishes + worker.num_publishes
                wall_s += seconds
    return StreamOverhead(num_rows, new_tokens, tuple(streamed), tuple(unstreamed),
                          publish_s * 1e3 / max(1, num_publishes), wall_s * 1e3 / (num_rounds * new_tokens))


def _serve_batch(engine: Engine, runtime: Runtime, requests: list[GenerationRequest], policy: BatchPolicy,
                 streamed: frozenset[StreamKind]) -> tuple[int, float, ServingWorker]:
    """The requests queued, then served by a fresh worker; -> tokens made, wall seconds, the worker."""
    streams = RequestStreams(runtime.redis, prefix=runtime.settings.key_prefix,
                             config_name=f"stream-{uuid.uuid4().hex[:8]}")
    worker = ServingWorker(engine=engine, streams=streams, sessions=runtime.sessions, name="stream-bench",
                           policy=policy, faults=FaultPolicy.from_settings(runtime.settings), streamed=streamed)
    streams.ensure_groups()
    ids = [_submit(worker, r, StreamKind.INTERACTIVE) for r in requests]  # NOTE: queued before the worker reads
    # NOTE: the relays run in a process of their own, as the API does: in the worker's process their threads
    # would take the GIL from the decode loop, a cost no deployment pays
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    relays = context.Process(target=read_all, args=(runtime.urls.redis_url, streams.prefix, ids, ready), daemon=True)
    relays.start()
    assert ready.wait(timeout=120), "the relay process did not start"
    thread = threading.Thread(target=worker.run, daemon=True)
    started = time.perf_counter()
    thread.start()
    try:
        for request_id in ids:
            assert wait_done(streams.client, prefix=streams.prefix, request_id=request_id, timeout_s=3600)
        wall_s = time.perf_counter() - started
        relays.join(timeout=60)
    finally:
        worker.stop.set()
        thread.join(timeout=120)
        if relays.is_alive():
            relays.kill()
    with session_scope(runtime.sessions) as session:
        return store.count_generated_tokens(session, ids=ids), wall_s, worker

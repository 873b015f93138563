"""The serving worker end to end on real Redis and PostgreSQL: batches, priorities, redelivery, lost entries."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError

import servelab.serving.worker as serving

from servelab.scheduler.policy import BatchPolicy
from servelab.queue.streams import GROUP, wait_done
from servelab.queue.submit import submit_request
from servelab.request import SamplingParams
from servelab.serving import FaultPolicy, measured_alone
from servelab.store.db import session_scope
from servelab.store.models import BatchRow, RequestMetricsRow, RequestRow, RequestStatus, ResultRow, StreamKind
from tests.queue.exactly_once import assert_each_ran_to_one_end, read_ledger, reference_token_ids

GREEDY = SamplingParams(max_new_tokens=6)


def submit(served, n: int, *, kind: StreamKind = StreamKind.INTERACTIVE, prompt: str = "the cat sat",
           sampling: SamplingParams | None = None) -> list[str]:
    return [submit_request(sessions=served.sessions, streams=served.streams, kind=kind, prompt=f"{prompt} {i}",
                           sampling=sampling or GREEDY) for i in range(n)]


def wait_all(served, ids: list[str], timeout_s: float = 60.0) -> dict[str, RequestRow]:
    deadline = time.monotonic() + timeout_s
    for request_id in ids:
        wait_done(served.streams.client, prefix=served.streams.prefix, request_id=request_id,
                  timeout_s=max(0.1, deadline - time.monotonic()))
    with session_scope(served.sessions) as session:
        rows = session.scalars(select(RequestRow).where(RequestRow.id.in_([uuid.UUID(i) for i in ids]))).all()
    assert {str(r.id) for r in rows} == set(ids), "a submitted request has no row"  # NOTE: no all() over nothing
    return {str(r.id): r for r in rows}


def batches_of(served) -> list[BatchRow]:
    with session_scope(served.sessions) as session:
        return list(session.scalars(select(BatchRow).where(BatchRow.serving_config_name == served.streams.config_name)
                                    .order_by(BatchRow.started_at)).all())


def test_burst_larger_than_max_batch_size_is_served_in_full_batches(make_served) -> None:
    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=300, max_batch_tokens=100_000))
    ids = submit(served, 10)
    served.start()
    rows = wait_all(served, ids)
    assert all(r.status is RequestStatus.SUCCEEDED for r in rows.values())
    assert [b.num_requests for b in batches_of(served)] == [4, 4, 2]


def test_lone_request_is_served_alone_when_the_window_closes(make_served) -> None:
    served = make_served(BatchPolicy(max_batch_size=8, max_wait_ms=100, max_batch_tokens=100_000))
    served.start()
    ids = submit(served, 1)
    assert wait_all(served, ids)[ids[0]].status is RequestStatus.SUCCEEDED
    assert [b.num_requests for b in batches_of(served)] == [1]  # the window, not a full batch, closed it


def test_kv_budget_caps_a_batch_of_long_requests(tiny_transformers_engine, engine, redis_client, key_prefix) -> None:
    """Without a paged pool (transformers' decoder), the KV budget counts every row at its worst case: no batch
    holds more rows than max_batch_tokens has room for. (A paged pool counts its real blocks: tests/scheduler.)"""
    from tests.queue.conftest import serving_workers

    long_prompt = "seven blue houses by the river " * 8  # about 50 tokens
    sampling = SamplingParams(max_new_tokens=50)
    with serving_workers(tiny_transformers_engine, engine, redis_client, key_prefix) as make:
        served = make(BatchPolicy(max_batch_size=8, max_wait_ms=300, max_batch_tokens=3 * 110))
        ids = submit(served, 6, prompt=long_prompt, sampling=sampling)
        served.start()
        wait_all(served, ids)
        sizes = [b.num_requests for b in batches_of(served)]
    assert max(sizes) <= 3 and sum(sizes) == 6, sizes


def test_interactive_requests_are_served_before_bulk(make_served) -> None:
    served = make_served(BatchPolicy(max_batch_size=1, max_wait_ms=0, max_batch_tokens=100_000))
    bulk = submit(served, 3, kind=StreamKind.BULK)
    interactive = submit(served, 1, kind=StreamKind.INTERACTIVE)
    served.start()
    rows = wait_all(served, bulk + interactive)
    order = sorted(rows.values(), key=lambda r: r.started_at)
    assert str(order[0].id) == interactive[0]


def test_metrics_are_ordered_and_token_counts_match_the_text(make_served, tiny_engine) -> None:
    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=50, max_batch_tokens=100_000))
    served.start()
    ids = submit(served, 3, sampling=SamplingParams(max_new_tokens=8, temperature=0.8, seed=7))
    rows = wait_all(served, ids)
    with session_scope(served.sessions) as session:
        results = {str(r.request_id): r for r in session.scalars(select(ResultRow).where(
            ResultRow.request_id.in_([uuid.UUID(i) for i in ids])))}
        metrics = {str(m.request_id): m for m in session.scalars(select(RequestMetricsRow).where(
            RequestMetricsRow.request_id.in_([uuid.UUID(i) for i in ids])))}
    for request_id, row in rows.items():
        assert row.enqueued_at <= row.started_at <= row.first_token_at <= row.finished_at
        result = results[request_id]
        assert result.num_generated_tokens == len(result.token_ids) == 8
        assert tiny_engine.tokenizer.decode(result.token_ids, skip_special_tokens=True) == result.text
        m = metrics[request_id]
        assert m.queue_ms >= 0 and m.ttft_ms <= m.e2e_ms and len(m.itl_ms) == 7
        assert row.num_attempts == 1


def test_redelivered_finished_request_is_acknowledged_not_served_again(make_served, tiny_engine) -> None:
    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=20, max_batch_tokens=100_000))
    served.start()
    ids = submit(served, 1)
    wait_all(served, ids)
    served.streams.enqueue(ids[0], StreamKind.INTERACTIVE)  # a duplicate entry for a finished request
    probe = submit(served, 1)  # served after the duplicate: the duplicate has been handled by then
    wait_all(served, probe)
    deadline = time.monotonic() + 60
    while (ledger := read_ledger(sessions=served.sessions, streams=served.streams, ids=ids + probe)).num_pending:
        assert time.monotonic() < deadline, "the probe was never acknowledged"  # NOTE: its ack follows its notice
        time.sleep(0.02)
    assert_each_ran_to_one_end(ledger, ids + probe, succeeded={*ids, *probe})  # notified once: not run again
    assert ledger.attempts == dict.fromkeys(ids + probe, 1)
    assert ledger.token_ids == reference_token_ids(tiny_engine, {ids[0]: "the cat sat 0", probe[0]: "the cat sat 0"},
                                                   max_new_tokens=GREEDY.max_new_tokens)


def test_a_bad_request_fails_alone_with_its_reason(make_served) -> None:
    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=200, max_batch_tokens=100_000))
    good = submit(served, 2)
    empty = [submit_request(sessions=served.sessions, streams=served.streams, prompt="", sampling=GREEDY)]
    too_long = [submit_request(sessions=served.sessions, streams=served.streams, prompt="cat " * 400,
                               sampling=GREEDY)]
    unreadable = [submit_request(sessions=served.sessions, streams=served.streams, prompt="the cat",
                                 sampling=GREEDY)]
    with session_scope(served.sessions) as session:  # as a foreign or older writer left it; no worker runs yet
        session.execute(update(RequestRow).where(RequestRow.id == uuid.UUID(unreadable[0]))
                        .values(sampling={"max_new_tokens": 4, "no_such_param": 1}))
    served.start()
    rows = wait_all(served, good + empty + too_long + unreadable)
    assert all(rows[i].status is RequestStatus.SUCCEEDED for i in good)
    assert rows[empty[0]].status is RequestStatus.FAILED and "prompt is empty" in rows[empty[0]].error
    assert rows[too_long[0]].status is RequestStatus.FAILED and "max_context_tokens" in rows[too_long[0]].error
    assert rows[unreadable[0]].status is RequestStatus.FAILED and "no_such_param" in rows[unreadable[0]].error


def test_lost_stream_entries_are_enqueued_again_and_served(make_served) -> None:
    served = make_served(BatchPolicy(max_batch_size=8, max_wait_ms=20, max_batch_tokens=100_000),
                         FaultPolicy(claim_idle_ms=200, renew_every_s=0.1))
    ids = submit(served, 5)
    client = served.streams.client
    for key in client.scan_iter(match=f"{served.streams.prefix}:*"):  # Redis restarted empty
        client.delete(key)
    time.sleep(0.3)  # NOTE: older than the grace period, as a lost entry would be
    assert served.worker.reap_lost() == 5
    served.start()
    rows = wait_all(served, ids)
    assert all(r.status is RequestStatus.SUCCEEDED and r.num_attempts == 1 for r in rows.values())


def test_a_workers_kv_budget_counts_the_models_shape_and_cache_dtype(tiny_engine, settings) -> None:
    from servelab.engine.engine import Engine
    from servelab.serving import batch_policy

    shape = tiny_engine.loaded.shape
    batching = tiny_engine.config.batching.model_copy(update={"max_kv_cache_mib": 1, "max_batch_tokens": 10**9})
    for cache_dtype, bytes_per_element in (("auto", 4), ("bf16", 2)):  # the tiny model computes in fp32
        config = tiny_engine.config.model_copy(update={"batching": batching, "kv_cache_dtype": cache_dtype})
        policy = batch_policy(Engine.from_config(config, settings))  # NOTE: an engine holds its own weights
        assert policy.max_batch_tokens == 2**20 // int(shape.kv_bytes_per_token(bytes_per_element))


# --- token-level serving, driven step by step: each worker.step() is one admission + one engine step ---

def live(served) -> list[str]:
    """The requests the worker's batch runs, in order of admission."""
    return [r.request_id for r in served.worker.running]


def statuses(served, ids: list[str]) -> list[RequestStatus]:
    with session_scope(served.sessions) as session:
        rows = {str(r.id): r.status for r in session.scalars(
            select(RequestRow).where(RequestRow.id.in_([uuid.UUID(i) for i in ids])))}
    return [rows[i] for i in ids]


def step_until(served, ids: list[str], *, max_steps: int = 500) -> int:
    """Step the worker until these requests are finished; -> the steps it took."""
    for n in range(1, max_steps + 1):
        served.worker.step()
        if all(s.is_terminal for s in statuses(served, ids)):
            return n
    raise AssertionError(f"not finished after {max_steps} steps")


CONTINUOUS = BatchPolicy(max_batch_size=4, max_wait_ms=0, max_batch_tokens=100_000, policy="continuous")
LONG = SamplingParams(max_new_tokens=40)


def test_a_rows_result_is_stored_when_it_finishes_not_when_its_batch_does(make_served) -> None:
    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=0, max_batch_tokens=100_000))
    served.streams.ensure_groups()
    long = submit(served, 1, kind=StreamKind.BULK, sampling=LONG)
    short = submit(served, 1, kind=StreamKind.BULK, sampling=SamplingParams(max_new_tokens=2))
    step_until(served, short)
    assert statuses(served, long) == [RequestStatus.RUNNING]  # its batch-mate still decodes
    assert wait_all(served, short, timeout_s=1)[short[0]].status is RequestStatus.SUCCEEDED  # notified already
    late = submit(served, 1)
    served.worker.step()
    assert live(served) == long  # window: nothing joins a running batch
    step_until(served, long + late)


def test_under_continuous_an_interactive_request_joins_running_rows_and_leaves_first(make_served) -> None:
    served = make_served(CONTINUOUS)
    served.streams.ensure_groups()
    bulk = submit(served, 2, kind=StreamKind.BULK, sampling=LONG)
    for _ in range(5):
        served.worker.step()
    interactive = submit(served, 1, sampling=SamplingParams(max_new_tokens=3))
    served.worker.step()
    assert set(live(served)) == {*bulk, *interactive}  # joined at the next step
    steps = step_until(served, interactive)
    assert steps <= 3 and statuses(served, bulk) == [RequestStatus.RUNNING] * 2
    step_until(served, bulk)
    assert served.streams.depth() == {"interactive": 0, "bulk": 0}


def test_a_full_batch_preempts_its_newest_bulk_row_which_still_finishes_once(make_served, tiny_engine) -> None:
    served = make_served(BatchPolicy(max_batch_size=2, max_wait_ms=0, max_batch_tokens=100_000, policy="continuous"))
    served.streams.ensure_groups()
    bulk = submit(served, 2, kind=StreamKind.BULK, sampling=LONG)
    for _ in range(5):
        served.worker.step()
    assert live(served) == bulk
    interactive = submit(served, 1, sampling=SamplingParams(max_new_tokens=3))
    served.worker.step()
    assert live(served) == [bulk[0], interactive[0]]  # the newest bulk row made room
    step_until(served, interactive)
    assert statuses(served, bulk) == [RequestStatus.RUNNING] * 2
    step_until(served, bulk)
    with session_scope(served.sessions) as session:
        rows = {str(r.id): r for r in session.scalars(select(RequestRow).where(
            RequestRow.id.in_([uuid.UUID(i) for i in bulk])))}
        results = {str(r.request_id): r for r in session.scalars(select(ResultRow).where(
            ResultRow.request_id.in_([uuid.UUID(i) for i in bulk])))}
        preempted = sum(b.num_preempted for b in session.scalars(
            select(BatchRow).where(BatchRow.serving_config_name == served.streams.config_name)))
    assert [rows[i].num_preemptions for i in bulk] == [0, 1] and preempted == 1
    assert all(rows[i].num_attempts == 1 and rows[i].status is RequestStatus.SUCCEEDED for i in bulk)
    from servelab.request import GenerationRequest

    alone = tiny_engine.generate([GenerationRequest("x", prompt="the cat sat 1", params=LONG)]).completions[0]
    assert tuple(results[bulk[1]].token_ids) == alone.token_ids  # started over: the same answer, stored once


def test_an_interactive_request_preempts_bulk_rows_whose_tokens_fill_the_pool_below_max_batch_size(
        tiny_folder, settings, engine, redis_client, key_prefix) -> None:
    """A pool of 12 blocks of 4 tokens, three bulk rows in a batch of up to 8: their generated tokens fill the pool
    while the batch has rows to spare. An interactive request then preempts the newest bulk row at once (the
    scheduler counts the pool's real free blocks), rather than waiting for a row to finish; every request is still
    served once."""
    from servelab.engine.engine import Engine
    from tests.engine.conftest import make_config
    from tests.queue.conftest import serving_workers

    small = Engine.from_config(make_config(str(tiny_folder), kv_cache={"block_size": 4},
                                           batching={"max_batch_tokens": 48, "max_prefill_tokens": 16},
                                           decoding={"max_new_tokens": 24, "max_context_tokens": 48}), settings)
    policy = BatchPolicy(max_batch_size=8, max_wait_ms=0, max_batch_tokens=48, policy="continuous", min_bulk_rows=0)
    with serving_workers(small, engine, redis_client, key_prefix) as make:
        served = make(policy)
        served.streams.ensure_groups()
        pool = served.worker.scheduler.pool
        assert pool.num_blocks == 12
        bulk = submit(served, 3, kind=StreamKind.BULK, sampling=SamplingParams(max_new_tokens=24, ignore_eos=True))
        for _ in range(40):
            served.worker.step()
            if len(served.worker.running) == 3 and pool.num_free_blocks <= 2:
                break
        assert len(served.worker.running) == 3 and pool.num_free_blocks <= 2, "the bulk rows never filled the pool"
        interactive = submit(served, 1, prompt="the cat sat on the mat and the dog", sampling=GREEDY)
        served.worker.step()
        assert interactive[0] in live(served)  # it got in at the next step
        assert sample_preemptions(served, "priority") == 1 and len(live(served)) == 3
        step_until(served, interactive + bulk)
        rows = wait_all(served, interactive + bulk)
    assert all(r.status is RequestStatus.SUCCEEDED and r.num_attempts == 1 for r in rows.values())


def sample_preemptions(served, cause: str) -> float:
    from servelab.telemetry import REGISTRY

    return REGISTRY.get_sample_value("servelab:num_preemptions_total",
                                     {"model_name": served.streams.config_name, "cause": cause}) or 0.0


def test_entries_with_the_same_id_in_both_streams_are_both_served(make_served) -> None:
    """Redis mints entry ids per stream: an interactive and a bulk entry can share one."""
    from servelab.store import requests as store

    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=0, max_batch_tokens=100_000))
    served.streams.ensure_groups()
    ids = []
    for kind, key in zip((StreamKind.INTERACTIVE, StreamKind.BULK), served.streams.keys):
        with session_scope(served.sessions) as session:
            ids.append(store.create_request(session, serving_config_name=served.streams.config_name, stream=kind,
                                            prompt="the cat", sampling=GREEDY))
        served.streams.client.xadd(key, {"request_id": ids[-1]}, id="1-1")
    served.streams.client.sadd(served.streams.enqueued_key, *ids)
    step_until(served, ids, max_steps=40)  # both, long before a take-over could find one left idle


# --- the claim keeper survives what the main loop survives ---

class KeeperTicks(threading.Event):
    """The keeper's wait between ticks, driven by the test: each wait moves a fake clock on by the time asked
    and returns at once; after `num_ticks` waits it is set, and the keeper ends. No wall clock anywhere."""

    def __init__(self, num_ticks: int, start_s: float = 1_000.0) -> None:
        super().__init__()
        self.now_s, self.left = start_s, num_ticks
        self.waits_s: list[float] = []

    def clock(self) -> float:
        return self.now_s

    def wait(self, timeout: float | None = None) -> bool:
        if self.left == 0:
            self.set()
        if self.is_set():
            return True
        assert timeout is not None, "the keeper waits a bounded time between ticks"
        self.waits_s.append(timeout)
        self.now_s += timeout
        self.left -= 1
        return False


def test_the_claim_keeper_outlives_database_errors_and_renews_beats_and_reaps_on_its_clock(make_served,
                                                                                            monkeypatch) -> None:
    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=20, max_batch_tokens=100_000),
                         FaultPolicy(renew_every_s=1.0, heartbeat_every_s=2.0, reap_every_s=3.0, claim_idle_ms=60_000))
    served.streams.ensure_groups()
    ids = submit(served, 2)
    served.worker._admit(served.streams.read_new(served.worker.name, count=4, block_ms=None))  # held, not served
    held = sorted(e.key for e in served.worker.held.entries.values())
    assert len(held) == 2
    ticks = KeeperTicks(num_ticks=12)
    served.worker.stop, served.worker.clock = ticks, ticks.clock
    beats, renewed, reaps, claims = [], [], [], []
    real_beat, real_renew, real_claim = serving.store.heartbeat, served.streams.renew, served.streams.claim_idle

    def failing_beat(session, *, name):  # PostgreSQL restarting: the first three beats fail
        beats.append(ticks.now_s)
        if len(beats) <= 3:
            raise OperationalError("UPDATE workers", {}, Exception("server closed the connection"))
        return real_beat(session, name=name)

    def counted_renew(consumer, entries):
        renewed.append(sorted(e.key for e in entries))
        return real_renew(consumer, entries)

    monkeypatch.setattr(serving.store, "heartbeat", failing_beat)
    monkeypatch.setattr(served.streams, "renew", counted_renew)
    monkeypatch.setattr(served.streams, "claim_idle", lambda *a, **k: claims.append(1) or real_claim(*a, **k))
    monkeypatch.setattr(served.worker, "reap_lost", lambda: reaps.append(ticks.now_s) or 0)
    served.worker._keep_claims()  # returns when the ticks run out: no error ended it
    assert ticks.waits_s == [1.0] * 12  # one tick per renew_every_s
    assert renewed == [held] * 12 and len(claims) == 12  # every tick renews everything held, errors or not
    assert beats == [1_001.0 + 2 * k for k in range(6)]  # every heartbeat_every_s, on through the three errors
    assert reaps == [1_001.0, 1_004.0, 1_007.0, 1_010.0]  # every reap_every_s
    # JUSTID: renewing never counts as a delivery (no take-over, no attempt)
    pending = [p for key in served.streams.keys
               for p in served.streams.client.xpending_range(key, GROUP, min="-", max="+", count=10)]
    assert sorted((p["consumer"].decode(), p["times_delivered"]) for p in pending) == [(served.worker.name, 1)] * 2


def test_a_worker_whose_claim_keeper_died_stops_loudly(make_served, monkeypatch) -> None:
    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=20, max_batch_tokens=100_000))
    monkeypatch.setattr(served.worker, "_keep_claims", lambda: None)  # the thread ends at once
    with pytest.raises(RuntimeError, match="the claim keeper stopped"):
        served.worker.run()


def test_a_cpu_worker_loads_and_measures_only_while_no_other_worker_of_its_cache_does(tmp_path) -> None:
    """Workers started together (a lab round) overlap their imports, then load and measure one at a time."""
    from servelab.config import ServingConfig
    from servelab.engine.model_files import file_lock
    from servelab.settings import Settings

    config = ServingConfig.from_dict({"name": "alone", "model": "bundled:smollm2-135m-instruct", "device": "cpu"})
    settings = Settings(cache_dir=tmp_path)
    entered = threading.Event()

    def start() -> None:
        with measured_alone(config, settings):
            entered.set()

    with file_lock(tmp_path / "kernels" / "load.lock"):  # another worker loading
        thread = threading.Thread(target=start)
        thread.start()
        assert not entered.wait(0.5), "a second worker measured while the first was loading"
    assert entered.wait(5), "the second worker never went on once the first was done"
    thread.join()


def test_a_worker_resizes_its_thread_team_after_each_step_and_says_its_size(make_served) -> None:
    """The worker ticks its team (threads.py) after every step; a host whose run delay says a core is taken (here a
    counter that grows half a second a second) shrinks it, `servelab:num_threads` shows the new size, and the answers
    are the same."""
    from servelab.engine.threads import ThreadGovernor
    from servelab.telemetry import REGISTRY

    sizes: list[int] = []
    governor = ThreadGovernor(2, window_s=0.0, read_delay=lambda: 0.5 * time.monotonic(), set_threads=sizes.append)
    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=0, max_batch_tokens=100_000, policy="continuous"))
    served.worker.threads = governor
    served.streams.ensure_groups()
    ids = submit(served, 2, sampling=SamplingParams(max_new_tokens=6, ignore_eos=True))
    step_until(served, ids)
    assert sizes == [1] and governor.threads == 1  # one shrink; no probe before probe_s
    assert REGISTRY.get_sample_value("servelab:num_threads", {"model_name": served.streams.config_name}) == 1
    assert all(r.status == RequestStatus.SUCCEEDED for r in wait_all(served, ids).values())

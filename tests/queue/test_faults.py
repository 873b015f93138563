"""Real worker processes killed with SIGKILL, crashing requests, and take-over by a live worker.

Exactly once is read from what would count above one if a request ran twice (tests/queue/exactly_once.py):
started executions, done notifications, completions written by batch records, entries left pending, and
each answer against the reference decoding of its prompt."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from servelab.queue.streams import RequestStreams
from servelab.queue.submit import submit_request
from servelab.request import SamplingParams
from servelab.store.db import session_factory, session_scope
from servelab.store.models import RequestRow, RequestStatus
from tests.queue.exactly_once import assert_each_ran_to_one_end, deliveries, read_ledger, reference_token_ids
from tests.conftest import service_env
from tests.forked_worker import ForkedWorker

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_new_tokens=5)


class WorkerProcesses:
    """Starts real worker processes (worker.gpu's main, with the faulty engine) and kills them."""

    def __init__(self, tmp_path: Path, tiny_folder: Path, service_settings, config_name: str,
                 policy: str = "window") -> None:
        self.config = tmp_path / f"{config_name}.yaml"
        self.config.write_text(
            f"name: {config_name}\nmodel: {tiny_folder}\nweights: fp32\ndevice: cpu\n"
            f"batching:\n  policy: {policy}\n  max_batch_size: 8\n  max_wait_ms: 300\n"
            "decoding:\n  max_new_tokens: 32\n  max_context_tokens: 128\n")
        self.marker = tmp_path / "stalled"
        self.env = {**os.environ, **service_env(service_settings, SERVELAB_CLAIM_IDLE_MS="1500",
                                                 SERVELAB_RENEW_EVERY_S="0.2",
                                                 SERVELAB_TEST_STALL_MARKER=str(self.marker), PYTHONPATH=str(REPO))}
        self.procs: list[ForkedWorker] = []

    def start(self, name: str) -> ForkedWorker:
        # NOTE: forked from a process that has imported the worker's code already (tests/forked_worker.py):
        # a fresh interpreter spends most of a worker's start importing torch, and these tests start many
        proc = ForkedWorker(str(self.config), env={**self.env, "SERVELAB_WORKER_NAME": name}, cwd=str(REPO),
                            faulty=True)
        self.procs.append(proc)
        return proc

    # NOTE: every timeout here is a liveness guard, generous for a busy machine (a worker compiling its kernels)
    def wait_for_stall(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.marker.exists():
            assert time.monotonic() < deadline, "the worker never reached the stalling batch"
            time.sleep(0.1)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(params=["window", "continuous"])
def workers(request, tmp_path, tiny_folder, service_settings):
    procs = WorkerProcesses(tmp_path, tiny_folder, service_settings, f"faulty-{uuid.uuid4().hex[:8]}",
                            policy=request.param)
    yield procs
    procs.close()


@pytest.fixture
def queue(workers, engine, redis_client, service_settings):
    streams = RequestStreams(redis_client, prefix=service_settings.key_prefix, config_name=workers.config.stem)
    return streams, session_factory(engine)


def submit_all(queue, prompts: list[str], sampling: SamplingParams = GREEDY) -> list[str]:
    streams, sessions = queue
    return [submit_request(sessions=sessions, streams=streams, prompt=p, sampling=sampling) for p in prompts]


def statuses_of(queue, ids: list[str]) -> list[RequestStatus]:
    _, sessions = queue
    with session_scope(sessions) as session:
        return list(session.scalars(select(RequestRow.status).where(RequestRow.id.in_([uuid.UUID(i) for i in ids]))))


def wait_status(queue, ids: list[str], status: RequestStatus, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        statuses = statuses_of(queue, ids)
        if statuses and all(s is status for s in statuses):
            return
        time.sleep(0.02)
    raise AssertionError(f"requests not {status} within {timeout_s} s")


def wait_finished(queue, ids: list[str], *, timeout_s: float = 300.0, until_exit: ForkedWorker | None = None) -> bool:
    """Poll until every request is finished (True) or the given process exits first (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(s.is_terminal for s in statuses_of(queue, ids)):
            return True
        if until_exit is not None and until_exit.poll() is not None:
            return False
        time.sleep(0.2)
    raise AssertionError(f"requests not finished within {timeout_s} s")


def settled_ledger(queue, ids: list[str], *, timeout_s: float = 300.0):
    """The ledger once every request has ended and its entry been acknowledged (which follows the commit)."""
    streams, sessions = queue
    deadline = time.monotonic() + timeout_s
    while True:
        ledger = read_ledger(sessions=sessions, streams=streams, ids=ids)
        if all(s.is_terminal for s in ledger.statuses.values()) and not ledger.num_pending:
            return ledger
        assert time.monotonic() < deadline, f"not settled within {timeout_s} s: {ledger}"
        time.sleep(0.1)


# NOTE: kill -9 and restart under continuous is its own test below, with rows at different stages
@pytest.mark.parametrize("workers", ["window"], indirect=True)
def test_kill_9_mid_batch_then_restart_finishes_every_request_exactly_once(workers, queue, tiny_engine) -> None:
    streams, _ = queue
    prompts = ["STALL here", *[f"the cat sat {i}" for i in range(5)]]
    ids = submit_all(queue, prompts)
    first = workers.start("w-restart")
    workers.wait_for_stall()
    assert deliveries(streams) == dict.fromkeys(ids, ("w-restart", 1))  # the whole batch in hand, delivered once
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    workers.start("w-restart")  # same consumer name: takes back its own pending entries at once
    assert wait_finished(queue, ids)
    ledger = settled_ledger(queue, ids)
    assert_each_ran_to_one_end(ledger, ids, succeeded=set(ids))
    assert ledger.attempts == dict.fromkeys(ids, 2)  # the killed run, then the finishing one
    assert ledger.token_ids == reference_token_ids(tiny_engine, dict(zip(ids, prompts)), max_new_tokens=5)


def test_kill_9_mid_step_with_rows_joined_at_different_steps_loses_and_repeats_nothing(tmp_path, tiny_folder,
                                                                                       service_settings, engine,
                                                                                       redis_client, tiny_engine) -> None:
    workers = WorkerProcesses(tmp_path, tiny_folder, service_settings, f"faulty-{uuid.uuid4().hex[:8]}",
                              policy="continuous")
    streams = RequestStreams(redis_client, prefix=service_settings.key_prefix, config_name=workers.config.stem)
    queue = (streams, session_factory(engine))
    try:
        early = submit_all(queue, ["SLOW river", "SLOW house"], SamplingParams(max_new_tokens=32))
        first = workers.start("w-steps")
        wait_status(queue, early, RequestStatus.RUNNING)
        short = submit_all(queue, ["a cat"], SamplingParams(max_new_tokens=1))  # joins, ends at its first token
        wait_finished(queue, short)
        late = submit_all(queue, ["STALL here", "blue mat"], SamplingParams(max_new_tokens=10))
        workers.wait_for_stall()
        stages = json.loads(workers.marker.read_text())  # request id -> tokens made when the step hung
        assert set(stages) == {*early, *late} and len(set(stages.values())) > 1, stages
        assert deliveries(streams) == dict.fromkeys([*early, *late], ("w-steps", 1))
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        workers.start("w-steps")
        ids = [*early, *short, *late]
        assert wait_finished(queue, ids)
        ledger = settled_ledger(queue, ids)
        assert_each_ran_to_one_end(ledger, ids, succeeded=set(ids))
        # finished and acknowledged before the kill: never run again; in flight at the kill: run once more
        assert ledger.attempts == {**dict.fromkeys([*early, *late], 2), short[0]: 1}
        assert ledger.token_ids == {
            **reference_token_ids(tiny_engine, dict(zip(early, ["SLOW river", "SLOW house"])), max_new_tokens=32),
            **reference_token_ids(tiny_engine, {short[0]: "a cat"}, max_new_tokens=1),
            **reference_token_ids(tiny_engine, dict(zip(late, ["STALL here", "blue mat"])), max_new_tokens=10)}
    finally:
        workers.close()


def test_a_live_worker_takes_over_a_dead_workers_pending_requests(workers, queue, tiny_engine) -> None:
    streams, _ = queue
    prompts = ["STALL here", *[f"a river {i}" for i in range(4)]]
    ids = submit_all(queue, prompts)
    doomed = workers.start("w-doomed")
    workers.wait_for_stall()
    assert deliveries(streams) == dict.fromkeys(ids, ("w-doomed", 1))
    workers.start("w-survivor")
    doomed.send_signal(signal.SIGKILL)  # killed for good: never restarted
    doomed.wait(timeout=30)
    assert wait_finished(queue, ids)
    ledger = settled_ledger(queue, ids)
    assert_each_ran_to_one_end(ledger, ids, succeeded=set(ids))
    assert ledger.attempts == dict.fromkeys(ids, 2)  # the dead worker's run, then the survivor's
    assert ledger.token_ids == reference_token_ids(tiny_engine, dict(zip(ids, prompts)), max_new_tokens=5)


def test_a_request_that_crashes_its_worker_three_times_fails_and_its_batch_mates_succeed(workers, queue,
                                                                                          tiny_engine) -> None:
    streams, _ = queue
    prompts = ["CRASH now", *[f"seven blue houses {i}" for i in range(4)]]
    ids = submit_all(queue, prompts)
    for _ in range(6):  # a supervisor restarting the crashed worker, as docker or systemd would
        proc = workers.start("w-poison")
        if wait_finished(queue, ids, until_exit=proc):
            break
        assert proc.returncode == 17, proc.returncode
    else:
        raise AssertionError("the poison request was never given up")
    ledger = settled_ledger(queue, ids)
    assert_each_ran_to_one_end(ledger, ids, succeeded=set(ids[1:]))
    assert ledger.statuses[ids[0]] is RequestStatus.FAILED and ledger.attempts[ids[0]] == 3
    assert "crashed its worker 3 times" in ledger.errors[ids[0]]
    assert ledger.token_ids == reference_token_ids(tiny_engine, dict(zip(ids[1:], prompts[1:])), max_new_tokens=5)
    dead = streams.client.xrange(streams.dead_letter_key)
    assert [fields[b"request_id"].decode() for _, fields in dead] == [ids[0]]

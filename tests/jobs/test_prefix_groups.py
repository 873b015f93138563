"""A batch job's lines that share a prompt prefix go out together: the key and the grouping alone, then slices
through the real ingest (PostgreSQL, Redis) and a feed round that shares a bounded queue between two jobs."""

from __future__ import annotations

import json
import uuid
from collections import Counter

from servelab.jobs.prefix_groups import PREFIX_KEY_CHARS, grouped_by_prefix, prefix_key
from servelab.queue.streams import stream_key
from servelab.store import batch_jobs as jobs
from servelab.store.db import session_scope
from servelab.store.models import StreamKind
from tests.jobs.conftest import CHAT, make_job
from tests.jobs.test_feed import feed_once, lines_read, live_config
from tests.jobs.test_ingest import assert_every_line_once, step

SYSTEMS = ("You answer for the library desk.", "You answer for the town hall.", "You answer for the museum.")


def test_the_key_is_the_opening_system_message_else_the_leading_text() -> None:
    def chat(*messages: tuple[str, str]) -> tuple[str, str]:
        return prefix_key(None, [{"role": role, "content": content} for role, content in messages])

    assert chat(("system", "Be brief."), ("user", "a")) == chat(("system", "Be brief."), ("user", "b"), ("user", "c"))
    assert chat(("system", "Be brief."), ("user", "a")) != chat(("system", "Be kind."), ("user", "a"))
    head = "h" * PREFIX_KEY_CHARS
    assert prefix_key(head + "one", None) == prefix_key(head + "two", None) == chat(("user", head + "three"))
    assert prefix_key("x" + head, None) != prefix_key("y" + head, None)
    assert chat(("system", "Be brief.")) != prefix_key("Be brief.", None), "a system message is not a plain prompt"


def test_groups_keep_the_order_of_their_first_line_and_lines_their_file_order() -> None:
    lines = ["a1", "b1", "a2", "c1", "b2", "a3"]
    assert grouped_by_prefix(lines, key=lambda s: s[0]) == ["a1", "a2", "a3", "b1", "b2", "c1"]
    assert grouped_by_prefix(lines, key=lambda s: s) == lines, "nothing shared: file order"
    assert grouped_by_prefix([], key=len) == []


def system_of(i: int) -> str | None:
    """Line i's system message: the three desks in turn, and every fifth line none."""
    return None if i % 5 == 4 else SYSTEMS[i % 3]


def chat_line(custom_id: str, model: str, i: int) -> str:
    messages = [{"role": "system", "content": system_of(i)}] if system_of(i) else []
    messages.append({"role": "user", "content": f"question {i}"})
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"model": model, "max_tokens": 2, "temperature": 0, "messages": messages}})


def job_file(model: str, prefix: str, num_lines: int) -> bytes:
    return ("\n".join(chat_line(f"{prefix}{i}", model, i) for i in range(num_lines)) + "\n").encode()


def grouped(prefix: str, line_numbers: range) -> list[str]:
    """Those lines as one slice sends them: by system message (the first seen first), in file order within each;
    lines without one apart, each its own."""
    return [f"{prefix}{i}" for i in grouped_by_prefix(line_numbers, key=lambda i: system_of(i) or f"alone {i}")]


def stream_custom_ids(stack, config: str) -> list[str]:
    """The config's bulk stream, oldest entry first, as the lines' custom_ids."""
    with session_scope(stack.runtime.sessions) as session:
        rows = {r.id: r.custom_id for job_id in stack.extra["jobs"] for r in jobs.iter_job_requests(session, job_id=job_id)}
    entries = stack.runtime.redis.xrange(stream_key(stack.settings.key_prefix, config, StreamKind.BULK))
    return [rows[fields[b"request_id"].decode()] for _, fields in entries]


def test_each_slice_goes_out_grouped_by_system_prompt_and_every_line_once(make_stack) -> None:
    stack = make_stack(with_worker=False)
    job = make_job(stack, job_file("fp32", "r-", 20), endpoint=CHAT)
    stack.extra["jobs"] = [job.id]
    for _ in range(3):  # slices of 7 lines: 0-6, 7-13, 14-19
        step(stack, job, per_step=7)
    assert stream_custom_ids(stack, "fp32") == grouped("r-", range(0, 7)) + grouped("r-", range(7, 14)) + \
        grouped("r-", range(14, 20))
    assert_every_line_once(stack, job, {f"r-{i}" for i in range(20)}, {}, num_lines=20)


def test_a_feed_round_still_shares_the_queue_line_by_line_and_groups_each_jobs_own_lines(make_stack) -> None:
    stack = make_stack(with_worker=False)
    config = live_config(stack, max_batch_size=2)  # NOTE: a bound of 4 batches of 2: 8 lines for the two jobs
    first = make_job(stack, job_file(config, "a-", 10), tenant=f"a-{uuid.uuid4().hex[:6]}", endpoint=CHAT)
    second = make_job(stack, job_file(config, "b-", 10), tenant=f"b-{uuid.uuid4().hex[:6]}", endpoint=CHAT)
    stack.extra["jobs"] = [first.id, second.id]
    feed_once(stack)  # one round, the bound on
    sent = stream_custom_ids(stack, config)
    num_a, num_b = lines_read(stack, first.id), lines_read(stack, second.id)
    assert len(sent) == num_a + num_b >= 2 and abs(num_a - num_b) <= 1, "equal weights: a line each per visit"
    assert all(x[0] != y[0] for x, y in zip(sent, sent[1:])), f"the jobs' lines alternate: {sent}"
    assert [c for c in sent if c[0] == "a"] == grouped("a-", range(num_a))
    assert [c for c in sent if c[0] == "b"] == grouped("b-", range(num_b))
    for _ in range(5):  # the rest, the bound off: each job's next slice, grouped on its own
        feed_once(stack, max_bulk_queued_batches=0)
    sent = stream_custom_ids(stack, config)
    assert Counter(sent) == Counter([f"a-{i}" for i in range(10)] + [f"b-{i}" for i in range(10)]), "each line once"
    assert [c for c in sent if c[0] == "a"] == grouped("a-", range(num_a)) + grouped("a-", range(num_a, 10))

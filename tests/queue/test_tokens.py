"""The relay between a token stream and a client: text once and in order, across a restarted generation."""

from __future__ import annotations

from servelab.queue.tokens import Diverged, Ended, Relay, Restarted, Shown, StepEvents, publish_step, tokens_key
from tests.queue.conftest import step_until_one_finishes


def _events(*texts: str, attempt: int = 1) -> list[dict]:
    at = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return [{"kind": "start", "attempt": attempt}, *({"kind": "text", "text": t, "at": a} for t, a in zip(texts, at))]


def test_a_restarted_generation_shows_only_what_goes_beyond_the_text_already_shown() -> None:
    relay = Relay()
    first = relay.feed(_events("The ", "cat"))
    again = relay.feed(_events("Th", "e c", "at sat", " down", attempt=2))
    end = relay.feed([{"kind": "end", "status": "succeeded", "finish_reason": "length", "prompt_tokens": 3,
                       "completion_tokens": 5}])
    assert first == [Shown("The "), Shown("cat")]
    assert again == [Restarted(2), Shown(" sat"), Shown(" down")]
    assert end == [Ended("succeeded", "length", 3, 5, None)] and relay.done and relay.shown == "The cat sat down"


def test_a_retried_generation_that_differs_ends_the_relay() -> None:
    relay = Relay()
    relay.feed(_events("The cat"))
    assert relay.feed(_events("The dog", attempt=2)) == [Restarted(2), Diverged()]
    assert relay.done and relay.feed([{"kind": "end", "status": "succeeded"}]) == []


def test_a_piece_sent_twice_is_shown_once_and_a_lost_one_ends_the_relay() -> None:
    relay = Relay()
    events = _events("ab", "cd")
    assert relay.feed([*events, events[-1]]) == [Shown("ab"), Shown("cd")]
    assert relay.feed([{"kind": "text", "text": "gh", "at": 6}]) == [Diverged()] and relay.done


def test_a_retried_generation_that_ends_short_of_the_text_shown_is_not_a_success() -> None:
    relay = Relay()
    relay.feed(_events("abc"))
    relay.feed(_events("ab", attempt=2))
    assert relay.feed([{"kind": "end", "status": "succeeded"}]) == [Diverged()]


def test_one_round_trip_publishes_a_step_and_reads_the_cancel_flags(redis_client, key_prefix) -> None:
    ids = ["a", "b", "c"]
    redis_client.set(f"{key_prefix}:cancel:b", "1")
    cancelled = publish_step(redis_client, prefix=key_prefix, events=StepEvents(
        started=(("a", 1, 3),), texts=(("a", 0, "hi", 1), ("c", 0, "yo", 2)), watched=tuple(ids)))
    assert cancelled == ["b"]
    assert redis_client.xlen(tokens_key(key_prefix, "a")) == 2 and redis_client.xlen(tokens_key(key_prefix, "c")) == 1
    assert 0 < redis_client.ttl(tokens_key(key_prefix, "a")) <= 600
    assert publish_step(redis_client, prefix=key_prefix, events=StepEvents()) == []


def test_text_a_redis_error_kept_from_its_step_goes_out_first_at_the_next(make_served, monkeypatch) -> None:
    import redis

    from servelab.serving import worker as serving
    from servelab.scheduler.policy import BatchPolicy
    from servelab.queue.submit import submit_request
    from servelab.queue.tokens import decode_event
    from servelab.request import SamplingParams
    from servelab.store import requests as store
    from servelab.store.db import session_scope

    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=5, max_batch_tokens=100_000))
    served.streams.ensure_groups()
    request_id = submit_request(sessions=served.sessions, streams=served.streams, prompt="once upon a time",
                                sampling=SamplingParams(max_new_tokens=12, ignore_eos=True))
    calls, real = [], serving.publish_step

    def flaky(client, **kwargs):
        calls.append(kwargs["events"])
        if len(calls) in (2, 3):
            raise redis.ConnectionError("Redis is restarting")
        return real(client, **kwargs)

    monkeypatch.setattr(serving, "publish_step", flaky)
    finished = step_until_one_finishes(served.worker, max_steps=40)
    assert finished == 1 and len(calls[3].texts) > len(calls[1].texts) >= 1  # the kept text rode with step 4
    events = [decode_event(f) for _, f in served.streams.client.xrange(tokens_key(served.streams.prefix, request_id))]
    with session_scope(served.sessions) as session:
        stored = store.get_request_view(session, request_id=request_id, tenant="default").text
    assert [e["kind"] for e in events][:1] == ["start"] and events[-1]["kind"] == "end"
    assert "".join(e["text"] for e in events if e["kind"] == "text") == stored


def test_a_newcomers_first_token_is_published_before_the_decode_step_that_makes_its_second(make_served,
                                                                                            monkeypatch) -> None:
    """The time to the second token is a decode step, not zero: the prefill's token leaves before the step."""
    from servelab.queue.submit import submit_request
    from servelab.queue.tokens import decode_event
    from servelab.request import GenerationRequest, SamplingParams
    from servelab.scheduler.policy import BatchPolicy

    served = make_served(BatchPolicy(max_batch_size=4, max_wait_ms=5, max_batch_tokens=100_000))
    served.streams.ensure_groups()
    request_id = submit_request(sessions=served.sessions, streams=served.streams, prompt="once upon a time",
                                sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine, runner, key = served.worker.engine, served.worker.engine.runner, tokens_key(served.streams.prefix, request_id)
    released, seen_before = [], []  # per step: the text it released, and what its stream held before it ran
    real_execute = runner.execute

    def execute(plan):
        seen_before.append([decode_event(f) for _, f in served.streams.client.xrange(key)])
        out = real_execute(plan)
        released.append([t for t in out.new_text if t[0] == request_id])
        return out

    monkeypatch.setattr(runner, "execute", execute)
    finished = step_until_one_finishes(served.worker, max_steps=20)
    prefilled = released[0]
    assert finished == 1 and prefilled, "the prefill released no text: pick another prompt"
    first_step = seen_before[1]  # what the step that makes its second token finds published
    assert [e["kind"] for e in first_step] == ["start", "text"]
    assert (first_step[1]["at"], first_step[1]["text"]) == prefilled[0][1:]
    # the usage so far rides along (vLLM's continuous usage): the prompt at the start, one token made
    prompt_ids = engine.tokenize(GenerationRequest(request_id, prompt="once upon a time")).prompt_token_ids
    assert first_step[0]["prompt_tokens"] == len(prompt_ids) and first_step[1]["tokens"] == 1

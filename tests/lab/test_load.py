"""The load generator against a small HTTP server of the test's own: every request sent once, answers read whole
over kept-alive connections, statuses counted, latencies of the successes, the figures' arithmetic."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from servelab.lab.load import Load, LoadResult, run_load


@contextmanager
def http_server() -> Iterator[tuple[str, list[int], list[bytes]]]:
    """Answers 201 with a body, and every third request 429; -> its URL, connections opened, request bodies."""
    connections: list[int] = []
    bodies: list[bytes] = []
    ready = threading.Event()
    state: dict = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                bodies.append(await reader.readexactly(length))
                status, body = (429, b'{"error": "full"}') if len(bodies) % 3 == 0 else (201, b'{"id": "x"}')
                writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        state["port"] = server.sockets[0].getsockname()[1]
        state["stop"] = asyncio.Event()
        ready.set()
        async with server:
            await state["stop"].wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield f"http://127.0.0.1:{state['port']}", connections, bodies
    finally:
        loop.call_soon_threadsafe(state["stop"].set)
        thread.join(10)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_every_request_is_sent_once_over_kept_alive_connections_and_counted(num_processes: int) -> None:
    with http_server() as (url, connections, bodies):
        result = run_load(Load(url, "POST", "/v1/requests", b'{"prompt": "hi"}', (("X-Test", "1"),), num_clients=4,
                               num_requests=30, num_processes=num_processes))
    assert len(bodies) == 30 and set(bodies) == {b'{"prompt": "hi"}'}
    assert len(connections) == 4, "one connection per client, kept alive"
    assert result.status_counts == {201: 20, 429: 10} and result.num_errors == 10
    assert len(result.latencies_ms) == 20 and all(ms > 0 for ms in result.latencies_ms)
    assert result.first_error is not None and result.first_error.startswith("429")
    assert result.elapsed_s > 0 and result.requests_per_s == pytest.approx(20 / result.elapsed_s)


def test_percentiles_are_nearest_rank_over_the_successes() -> None:
    result = LoadResult(num_requests=100, elapsed_s=2.0, latencies_ms=tuple(float(i) for i in range(100, 0, -1)),
                        status_counts={200: 100})
    assert result.percentile_ms(50) == 50.0 and result.percentile_ms(99) == 99.0 and result.percentile_ms(100) == 100.0
    assert result.requests_per_s == 50.0 and result.num_errors == 0
    assert LoadResult(1, 1.0, (), {0: 1}).percentile_ms(50) == 0.0

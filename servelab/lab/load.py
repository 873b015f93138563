"""A load generator for HTTP APIs: N keep-alive connections in P processes send M requests, as fast as answers come.

Knows raw HTTP/1.1 over asyncio streams (one request in flight per connection, Content-Length bodies, no
chunked answers, which FastAPI's JSON answers never are), each request's latency and status, and the
arithmetic of the figures (requests/s over the whole run, p50 / p99). Does not know what the requests mean.
NOTE: a raw client, not httpx: httpx spends ~1 ms of CPU per request, so on 2 cores it, not the server,
would set the figure; `servelab bench api --target healthz` measures this client's own ceiling.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 65_536


@dataclass(frozen=True)
class Load:
    """What to send: one request's bytes (sent again and again), and how hard."""

    url: str  # the base URL: scheme, host and port are used, the path is the request's own
    method: str
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...]
    num_clients: int
    num_requests: int
    num_processes: int = 1

    def request_bytes(self) -> bytes:
        host = urlsplit(self.url).netloc
        lines = [f"{self.method} {self.path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(self.body)}",
                 *(f"{name}: {value}" for name, value in self.headers)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body


@dataclass(frozen=True)
class LoadResult:
    num_requests: int
    elapsed_s: float  # first request sent to last answer read, over every process
    latencies_ms: tuple[float, ...]  # of the successful (2xx) answers, in order of completion
    status_counts: dict[int, int]  # status code -> answers; 0 counts connection errors
    first_error: str | None = None  # a non-2xx answer's body, or the connection error, for the report

    @property
    def num_errors(self) -> int:
        return sum(n for status, n in self.status_counts.items() if not 200 <= status < 300)

    @property
    def requests_per_s(self) -> float:
        """Successful answers per second of the whole run."""
        return len(self.latencies_ms) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        """Nearest-rank percentile of the successful answers' latencies (0 when none succeeded)."""
        if not self.latencies_ms:
            return 0.0
        ordered = sorted(self.latencies_ms)
        rank = max(1, min(len(ordered), math.ceil(q * len(ordered) / 100)))
        return ordered[rank - 1]


def run_load(load: Load) -> LoadResult:
    """Send the load and wait for every answer; the processes (when more than one) start together."""
    assert load.num_clients >= load.num_processes >= 1, "each process drives at least one connection"
    shares = [_share(load.num_requests, load.num_processes, i) for i in range(load.num_processes)]
    clients = [_share(load.num_clients, load.num_processes, i) for i in range(load.num_processes)]
    if load.num_processes == 1:
        parts = [_run_part(load, clients[0], shares[0], None)]
    else:
        context = multiprocessing.get_context("spawn")  # NOTE: no fork of a process holding connections
        with context.Manager() as manager:
            barrier = manager.Barrier(load.num_processes)
            with context.Pool(load.num_processes) as pool:
                parts = pool.starmap(_run_part, [(load, c, n, barrier) for c, n in zip(clients, shares)])
    return _merge(load.num_requests, parts)


def _share(total: int, num_parts: int, index: int) -> int:
    return total // num_parts + (1 if index < total % num_parts else 0)


@dataclass(frozen=True)
class _Part:
    started_s: float
    finished_s: float
    latencies_ms: list[float]
    status_counts: dict[int, int]
    first_error: str | None


def _merge(num_requests: int, parts: list[_Part]) -> LoadResult:
    counts: dict[int, int] = {}
    for part in parts:
        for status, n in part.status_counts.items():
            counts[status] = counts.get(status, 0) + n
    elapsed = max(p.finished_s for p in parts) - min(p.started_s for p in parts)
    latencies = tuple(ms for p in parts for ms in p.latencies_ms)
    first_error = next((p.first_error for p in parts if p.first_error), None)
    return LoadResult(num_requests, elapsed, latencies, counts, first_error)


def _run_part(load: Load, num_clients: int, num_requests: int, barrier) -> _Part:
    try:
        import uvloop  # NOTE: optional; the figures are the server's as long as the client has room to spare

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_drive(load, num_clients, num_requests, barrier))


async def _drive(load: Load, num_clients: int, num_requests: int, barrier) -> _Part:
    parts = urlsplit(load.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)
    assert parts.scheme == "http", f"{load.url}: only plain http is driven"
    connections = [await asyncio.open_connection(host, port) for _ in range(num_clients)]
    if barrier is not None:
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
    request = load.request_bytes()
    remaining = [num_requests]
    latencies: list[float] = []
    counts: dict[int, int] = {}
    errors: list[str] = []
    started = time.time()
    await asyncio.gather(*(_client(reader, writer, request, remaining, latencies, counts, errors)
                           for reader, writer in connections))
    finished = time.time()
    for _, writer in connections:
        writer.close()
    return _Part(started, finished, latencies, counts, errors[0] if errors else None)


async def _client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, remaining: list[int],
                  latencies: list[float], counts: dict[int, int], errors: list[str]) -> None:
    """One connection: send, read the whole answer, send again, while requests remain."""
    while remaining[0] > 0:
        remaining[0] -= 1
        sent = time.perf_counter()
        try:
            writer.write(request)
            status, body = await _read_answer(reader)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            counts[0] = counts.get(0, 0) + 1
            errors.append(f"{type(exc).__name__}: {exc}")
            return  # NOTE: this connection is gone; the others carry on with what remains
        counts[status] = counts.get(status, 0) + 1
        if 200 <= status < 300:
            latencies.append((time.perf_counter() - sent) * 1e3)
        elif not errors:
            errors.append(f"{status}: {body[:300].decode(errors='replace')}")


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError("an answer's header is too long")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
        elif name.strip().lower() == b"transfer-encoding":
            raise ValueError("a chunked answer: this client reads Content-Length bodies only")
    return status, await reader.readexactly(length) if length else b""

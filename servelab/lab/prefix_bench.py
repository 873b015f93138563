"""`servelab bench prefix`: one batch job whose lines share a long system prompt, through the real Batch API of a
stack this bench starts, served by a config with prefix caching off and by one with it on, side by side in one run.

Knows how to start the stack's processes (servelab/stack.py: the api, jobs-worker, beat and a gpu-worker per
config) on a throwaway database and key prefix of the local stack's servers, find each worker's /metrics port in
its log, write the job's file (the workload's built-in system prompt, then a ticket number and a question of its
own per line), upload it and create the batch over HTTP, follow it to its end, and read the prefix-cache counters
(`servelab:prefix_cache_queries_total`, `servelab:prefix_cache_hits_total`) before and after from the worker
that served it. Does not judge (it prints ratios, never asserts a time) and does not parse options or print.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from servelab.analysis.workload import builtin_prompts, system_prompt
from servelab.config import ServingConfig
from servelab.lab.ingest_bench import throwaway_stack
from servelab.settings import Settings
from servelab.stack import StackError, is_running, start_stack, stop_stack
from servelab.store import keys
from servelab.store.db import session_scope

ENDPOINT = "/v1/chat/completions"
TENANT = "bench-prefix"
QUERIES, HITS = "servelab:prefix_cache_queries_total", "servelab:prefix_cache_hits_total"
WORKER_START_TIMEOUT_S = 600.0
JOB_TIMEOUT_S = 7_200.0
POLL_S = 0.25  # how often the job is read, and the jobs-worker advances jobs (SERVELAB_JOBS_POLL_S)
ENDED = ("completed", "failed", "expired", "cancelled")
_METRICS_LINE = re.compile(r"serving (?P<config>\S+) \(.*/metrics on port (?P<port>\d+)")


class PrefixBenchError(RuntimeError):
    """The bench's stack or job did not do its part; the message names the step (and the log to read)."""


@dataclass(frozen=True)
class PrefixJob:
    """One side's job in one round."""

    config: str
    round_no: int
    wall_s: float  # the batch's creation to its `completed` status, read every POLL_S
    num_completed: int
    num_failed: int
    input_tokens: int
    output_tokens: int
    queries: float | None  # prompt tokens the worker looked up in its prefix cache during the job; None: no counter
    hits: float | None  # of those, tokens found there
    answers: dict[str, str] = field(default_factory=dict, repr=False)  # custom_id -> the answer's text

    @property
    def hit_rate(self) -> float | None:
        if self.queries is None or self.hits is None or self.queries <= 0:
            return None
        return self.hits / self.queries


@dataclass(frozen=True)
class BenchStack:
    """The started stack: the api's URL and key, and each config's worker /metrics URL."""

    api_url: str
    api_key: str
    metrics_urls: dict[str, str]


def batch_lines(model: str, *, num_lines: int, max_new_tokens: int) -> bytes:
    """The job's file: every line opens with the library desk's system prompt (workloads/shared-prefix.yaml's)
    and asks its own question, with a ticket number first so no two lines' tails are the same."""
    system, questions = system_prompt("library"), builtin_prompts("library")
    lines = []
    for i in range(num_lines):
        body = {"model": model, "max_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"Ticket {1001 + i}: {questions[i % len(questions)]}"}]}
        lines.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": ENDPOINT, "body": body}))
    return ("\n".join(lines) + "\n").encode()


def prefix_cache_counts(exposition: str) -> tuple[float | None, float | None]:
    """The prefix-cache query and hit token counters of a /metrics page, summed over their labels; None where
    the page has no such counter (a worker from before the paged cache)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in (QUERIES, HITS):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found.get(QUERIES), found.get(HITS)


def round_order(names: list[str], round_no: int) -> list[str]:
    """Baseline first in odd rounds, last in even ones, so running first or second weighs on both alike."""
    return list(names) if round_no % 2 == 1 else list(reversed(names))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def bench_stack(settings: Settings, config_paths: list[Path], *, progress: Callable[[str], None]) -> Iterator[BenchStack]:
    """The api, jobs-worker, beat and a gpu-worker per config, on a throwaway database and key prefix, each
    worker awaited (loaded and registered); everything stopped and removed on exit, however it ends."""
    names = [ServingConfig.from_yaml(p).name for p in config_paths]
    with throwaway_stack(settings, label="prefix") as runtime, \
            tempfile.TemporaryDirectory(prefix="servelab-bench-prefix-") as folder:
        with session_scope(runtime.sessions) as session:
            api_key = keys.create_key(session, tenant=TENANT)
        state = Settings(state_dir=Path(folder), key_prefix=runtime.settings.key_prefix)
        env = {"SERVELAB_REDIS_URL": runtime.urls.redis_url, "SERVELAB_DATABASE_URL": runtime.urls.database_url,
               "SERVELAB_KEY_PREFIX": runtime.settings.key_prefix, "SERVELAB_STATE_DIR": folder,
               "SERVELAB_CACHE_DIR": str(Path(settings.cache_dir).resolve()), "SERVELAB_CONFIGS_DIR": folder,
               "SERVELAB_JOBS_POLL_S": str(POLL_S), "SERVELAB_WORKER_METRICS_PORT": "8001"}  # NOTE: or the next free
        port = free_port()
        progress(f"starting the api on port {port}, the jobs-worker, beat and a worker for each of {', '.join(names)}")
        try:
            started = start_stack(state, env=env, config_paths=config_paths, api_port=port, api_workers=1)
            workers = {c.process.name.removeprefix("gpu-worker-"): c.process for c in started
                       if c.process.name.startswith("gpu-worker-")}
            ports = {name: _await_worker(workers[path.stem], name) for path, name in zip(config_paths, names)}
            yield BenchStack(f"http://127.0.0.1:{port}", api_key,
                             {name: f"http://127.0.0.1:{p}/metrics" for name, p in ports.items()})
        except StackError as exc:
            raise PrefixBenchError(str(exc)) from None
        finally:
            stop_stack(state)


def _await_worker(process, config_name: str) -> int:
    """The worker's /metrics port, read from the line it logs once it has loaded and registered."""
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = Path(process.log).read_text(errors="replace") if Path(process.log).exists() else ""
        for match in _METRICS_LINE.finditer(text):
            if match["config"] == config_name:
                return int(match["port"])
        if "/metrics on port (none)" in text:
            raise PrefixBenchError(f"the worker for {config_name} found no free /metrics port; see {process.log}")
        if not is_running(process):
            raise PrefixBenchError(f"the worker for {config_name} exited while starting; see {process.log}")
        time.sleep(0.5)
    raise PrefixBenchError(f"the worker for {config_name} did not start within {WORKER_START_TIMEOUT_S:.0f} s; "
                           f"see {process.log}")


def run_prefix_bench(settings: Settings, config_paths: list[Path], *, num_lines: int, max_new_tokens: int,
                     num_rounds: int, progress: Callable[[str], None] = lambda _: None) -> list[PrefixJob]:
    """Per round, the same job for each config in turn (round_order); -> a PrefixJob per config and round."""
    names = [ServingConfig.from_yaml(p).name for p in config_paths]
    with bench_stack(settings, config_paths, progress=progress) as stack, \
            httpx.Client(base_url=stack.api_url, timeout=600,
                         headers={"Authorization": f"Bearer {stack.api_key}"}) as client:
        for name in names:  # NOTE: a fresh process's first batches pay for lazy set-up; not the job's prefix
            _checked(client.post(ENDPOINT, json={"model": name, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "Say hello."}]}))
        jobs = []
        for round_no in range(1, num_rounds + 1):
            for name in round_order(names, round_no):
                progress(f"round {round_no}/{num_rounds}: {num_lines} lines for {name}")
                content = batch_lines(name, num_lines=num_lines, max_new_tokens=max_new_tokens)
                jobs.append(_run_job(client, stack.metrics_urls[name], name, round_no, content))
    return jobs


def _run_job(client: httpx.Client, metrics_url: str, name: str, round_no: int, content: bytes) -> PrefixJob:
    uploaded = _checked(client.post("/v1/files", data={"purpose": "batch"},
                                    files={"file": ("prefix.jsonl", content, "application/jsonl")}))
    before = prefix_cache_counts(httpx.get(metrics_url, timeout=10).text)
    started = time.perf_counter()
    batch = _checked(client.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": ENDPOINT,
                                                      "completion_window": "24h"}))
    while batch["status"] not in ENDED:
        if time.perf_counter() - started > JOB_TIMEOUT_S:
            raise PrefixBenchError(f"batch {batch['id']} for {name} did not end within {JOB_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)
        batch = _checked(client.get(f"/v1/batches/{batch['id']}"))
    wall_s = time.perf_counter() - started
    if batch["status"] != "completed":
        raise PrefixBenchError(f"batch {batch['id']} for {name} ended {batch['status']}: {batch.get('errors')}")
    after = prefix_cache_counts(httpx.get(metrics_url, timeout=10).text)
    queries, hits = (None if a is None else a - (b or 0.0) for a, b in zip(after, before))
    counts, usage = batch["request_counts"], batch["usage"]
    output = client.get(f"/v1/files/{batch['output_file_id']}/content") if batch["output_file_id"] else None
    if output is not None and output.status_code >= 400:
        _checked(output)
    return PrefixJob(name, round_no, wall_s, counts["completed"], counts["failed"], usage["input_tokens"],
                     usage["output_tokens"], queries, hits, answers(output.content if output is not None else b""))


def answers(output_file: bytes) -> dict[str, str]:
    """A chat batch's output file -> each line's answer text, by custom_id."""
    found = {}
    for raw in output_file.splitlines():
        record = json.loads(raw)
        found[record["custom_id"]] = record["response"]["body"]["choices"][0]["message"]["content"]
    return found


def _checked(response: httpx.Response) -> dict:
    if response.status_code >= 400:
        raise PrefixBenchError(f"{response.request.method} {response.request.url.path}: {response.status_code}: "
                               f"{response.text[:500]}")
    return response.json()


def format_prefix_table(jobs: list[PrefixJob], names: list[str]) -> str:
    """A row per job, then each config's wall time against the first's (median of the rounds' ratios)."""
    lines = [f"{'round':>5}  {'config':<32} {'wall s':>8} {'lines done':>10} {'prompt tok/line':>15} "
             f"{'hit rate':>15}"]
    for job in sorted(jobs, key=lambda j: (j.round_no, names.index(j.config))):
        per_line = job.input_tokens / max(1, job.num_completed + job.num_failed)
        rate = "n/a" if job.hit_rate is None else f"{100 * job.hit_rate:.1f} %"
        lines.append(f"{job.round_no:>5}  {job.config:<32} {job.wall_s:>8.1f} "
                     f"{f'{job.num_completed}/{job.num_completed + job.num_failed}':>10} {per_line:>15.0f} {rate:>15}")
    base = names[0]
    by_round = {(j.config, j.round_no): j for j in jobs}
    for name in names[1:]:
        ratios = [by_round[(name, r)].wall_s / by_round[(base, r)].wall_s
                  for r in sorted({j.round_no for j in jobs}) if (name, r) in by_round and (base, r) in by_round]
        if ratios:
            ratio = statistics.median(ratios)
            lines.append(f"{name} against {base}: wall time x{ratio:.3f} (median of {len(ratios)} round(s); "
                         f"{1 / ratio:.2f} times as fast)")
        same, common = 0, 0
        for r in sorted({j.round_no for j in jobs}):
            if (name, r) in by_round and (base, r) in by_round:
                theirs, ours = by_round[(base, r)].answers, by_round[(name, r)].answers
                common += len(theirs.keys() & ours.keys())
                same += sum(theirs[k] == ours[k] for k in theirs.keys() & ours.keys())
        lines.append(f"{name} against {base}: identical greedy answers on {same} of {common} lines")
    lines.append("hit rate: servelab:prefix_cache_hits_total / servelab:prefix_cache_queries_total over the job, "
                 "from the worker's /metrics (n/a: the worker exports no such counter)")
    return "\n".join(lines)

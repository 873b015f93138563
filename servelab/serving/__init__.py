"""The GPU worker: its serving loop (worker.py: the shell around the scheduler and the runner) and the start of its
process (process.py: load, register, serve until a signal)."""

from servelab.serving.process import batch_policy, default_worker_name, kv_pool, measured_alone, run_worker
from servelab.serving.worker import FaultPolicy, ServingWorker

__all__ = ["FaultPolicy", "ServingWorker", "batch_policy", "default_worker_name", "kv_pool", "measured_alone",
           "run_worker"]

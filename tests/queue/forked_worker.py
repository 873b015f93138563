"""Worker processes for the fault tests, forked from a process that has already imported the worker's code.

A fresh `python -m tests.queue.faulty_worker` spends most of its start importing torch, transformers and
servelab's engine (about 10 s on a busy 2-core machine, several times its model load), and the fault tests
start about twenty. Here a multiprocessing fork server imports tests.queue.faulty_worker once (the faulty step
patched in) and each worker is forked from it: a process of its own, with its own pid, environment, working
directory, and the stdout and stderr the test has when it starts it (as a subprocess would), that runs
worker.gpu's main (reads its Settings, loads its model, registers, serves), exits with its own code and dies
to SIGKILL like any process. The fork server is a fresh interpreter that has only imported (no thread, no
model), not the test process.

Knows how to start, signal and wait for such a process; nothing of what the tests check.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
from multiprocessing import reduction, resource_tracker

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["tests.queue.faulty_worker"])


class _Fd:
    """One of this process's file descriptors, handed to the child by the fork server (SCM_RIGHTS)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        # NOTE: DupFd only works while multiprocessing pickles the process it starts
        return _received, (reduction.DupFd(self.fd),)


def _received(wrapped) -> int:
    return wrapped.detach()


def _serve(config: str, env: dict[str, str], cwd: str, stdout: int, stderr: int) -> None:
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # NOTE: a resource tracker of its own, as a fresh interpreter has: what a killed worker leaves (tqdm's
    # semaphore) is then cleaned up, and reported, when it dies, not at the end of the test session
    resource_tracker._resource_tracker = resource_tracker.ResourceTracker()
    from worker.gpu import main

    raise SystemExit(main([config]))


class ForkedWorker:
    """What the tests use of subprocess.Popen: pid, poll(), wait(), send_signal(), kill(), returncode."""

    def __init__(self, config: str, *, env: dict[str, str], cwd: str) -> None:
        self._process = _CONTEXT.Process(target=_serve, args=(config, env, cwd, _Fd(1), _Fd(2)), daemon=False)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # NOTE: as Popen's: the exit status, or minus the signal that ended it

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

"""Worker processes forked from a process that has already imported the worker's code.

A fresh `python -m worker.gpu` spends most of its start importing torch, transformers and servelab's engine (6-10 s
on a 2-core machine, several times its model load), and the fault tests and the lab's tests start dozens. Here a
multiprocessing fork server imports worker.gpu once and each worker is forked from it: a process of its own, with its
own pid, environment, working directory, and the output the test gives it (the test's own stdout and stderr, or a log
file, as a subprocess would have), that runs worker.gpu's main (reads its Settings, loads its model, registers,
serves), exits with its own code and dies to SIGTERM and SIGKILL like any process. A faulty worker imports
tests.queue.faulty_worker first (its runners' steps crash or stall on marked prompts). The fork server is a fresh
interpreter that has only imported (no thread, no model), not the test process.

Knows how to start, signal and wait for such a process; nothing of what the tests check. The lab's own start of a
worker (`python -m worker.gpu`, servelab.lab.runner.spawn_worker) stays covered by the tests that do not fork.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
from multiprocessing import reduction, resource_tracker
from pathlib import Path
from typing import BinaryIO

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["worker.gpu"])


class _Fd:
    """One of this process's file descriptors, handed to the child by the fork server (SCM_RIGHTS)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        # NOTE: DupFd only works while multiprocessing pickles the process it starts
        return _received, (reduction.DupFd(self.fd),)


def _received(wrapped) -> int:
    return wrapped.detach()


def _serve(config: str, env: dict[str, str], cwd: str, stdout: int, stderr: int, faulty: bool) -> None:
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # NOTE: a resource tracker of its own, as a fresh interpreter has: what a killed worker leaves (tqdm's
    # semaphore) is then cleaned up, and reported, when it dies, not at the end of the test session
    resource_tracker._resource_tracker = resource_tracker.ResourceTracker()
    if faulty:
        import tests.queue.faulty_worker  # noqa: F401 (patches the runners' steps)
    from worker.gpu import main

    raise SystemExit(main([config]))


class ForkedWorker:
    """What the tests use of subprocess.Popen: pid, poll(), wait(), send_signal(), terminate(), kill(), returncode."""

    def __init__(self, config: str, *, env: dict[str, str], cwd: str, faulty: bool = False,
                 output: int | None = None) -> None:
        """output: a file descriptor for both stdout and stderr (default: this process's own two)."""
        out, err = (_Fd(output), _Fd(output)) if output is not None else (_Fd(1), _Fd(2))
        self._process = _CONTEXT.Process(target=_serve, args=(config, env, cwd, out, err, faulty), daemon=False)
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

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_lab_worker(config_path: Path, env: dict[str, str], log: BinaryIO) -> ForkedWorker:
    """servelab.lab.runner.spawn_worker's stand-in: the same worker, forked, in the same working directory."""
    from servelab.lab.runner import REPO  # NOTE: here, not at the top: every forked child imports this module

    return ForkedWorker(str(config_path), env=env, cwd=str(REPO), output=log.fileno())

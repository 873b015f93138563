"""The runner's side of an engine adapter: a long-lived subprocess under the engine's own python.

Knows how to start an adapter with the thread variables set, wait for its ready line, send a request
and wait for the answer with a deadline (a reader thread feeds a queue, so a silent or dead adapter
becomes an EngineError instead of a hang), hold it stopped (SIGSTOP) while other engines are measured,
and stop it. Holding matters: an idle vLLM engine core polls and took 10-30 % of a core in a first run,
which every other engine's figures paid for. The adapter's stderr goes to a log file, which
an error message points to. Does not know what the numbers mean: bench/peers/measure.py does.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from bench.peers.peers import ROOT
from bench.peers.protocol import AdapterArgs, Request, adapter_argv, thread_env


def _die_with_parent() -> None:
    """In the adapter, before it runs: the kernel sends it SIGKILL when the runner dies, however the runner
    ends (even SIGKILL, which runs no cleanup) and even while it is held stopped, when no closed pipe
    would reach it. Linux's prctl(PR_SET_PDEATHSIG); elsewhere the runner's own cleanup is all there is."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class EngineError(RuntimeError):
    """The adapter failed to load, died, answered nonsense or took too long."""


class EngineProcess:
    def __init__(self, python: Path, module: str, args: AdapterArgs, log_path: Path) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        env = {**os.environ, **thread_env(args.threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.pop("VIRTUAL_ENV", None)
        self._proc = subprocess.Popen(
            [str(python), "-m", module, *adapter_argv(args)], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.dead: str | None = None  # why this adapter can take no more calls

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        message = self._receive(timeout_s)
        if not message.get("ready"):
            self._fail(f"load failed: {message.get('error', message)} (log: {self.log_path})")
        return message

    def call(self, request: Request, timeout_s: float) -> dict[str, Any]:
        """One generate call; an {"error": ...} answer is returned, a broken adapter raises."""
        if self.dead:
            raise EngineError(self.dead)
        try:
            self._proc.stdin.write(request.to_line())
            self._proc.stdin.flush()
        except OSError as exc:
            self._fail(f"adapter is gone ({exc}); log: {self.log_path}")
        return self._receive(timeout_s)

    def hold(self) -> None:
        """Stop the adapter and anything it started until `release`: an idle engine takes no CPU."""
        self._signal(signal.SIGSTOP)
        # NOTE: the signal is delivered asynchronously; measuring the next engine must not start before the
        # adapter has really stopped (on a busy machine that takes a moment).
        deadline = time.monotonic() + 5.0
        while self._proc.poll() is None and self._state() != "T" and time.monotonic() < deadline:
            time.sleep(0.005)

    def _state(self) -> str:
        try:
            return Path(f"/proc/{self._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "?"

    def release(self) -> None:
        self._signal(signal.SIGCONT)

    @contextmanager
    def running(self) -> Iterator[None]:
        self.release()
        try:
            yield
        finally:
            self.hold()

    def _signal(self, signum: int) -> None:
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signum)  # NOTE: its own session: the adapter and its children
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.release()
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self._proc.kill()
            self._fail(f"no answer within {timeout_s:.0f} s, killed; log: {self.log_path}")
        if line is None:
            self._fail(f"adapter exited with code {self._proc.wait()}; log: {self.log_path}")
        try:
            return json.loads(line)
        except ValueError:
            self._fail(f"adapter wrote a non-JSON line {line[:80]!r}; log: {self.log_path}")

    def _fail(self, reason: str) -> None:
        self.dead = reason
        raise EngineError(reason)

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

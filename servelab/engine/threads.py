"""A serving worker's thread team on a busy host: shrink it while other processes take its cores, grow it back when
they leave.

servelab's kernels split each operation evenly over torch's threads and wait for the last at every barrier (several a
layer). When another process holds one of the team's cores, the thread on that core runs in the time slices the
scheduler grants it, and every barrier waits for its next slice: a step that takes milliseconds on a quiet host takes
seconds (at 2 threads with one busy process beside, x20 slower than 1 thread). Spinning shorter or sleeping sooner at
the barrier does not help: the wait is for the descheduled thread's own work. A team without the taken core does not
wait for it.

The signal is the kernel's own: the time this process's threads spent runnable but not running (run delay, the second
field of /proc/self/task/*/schedstat). On a quiet host it stays near zero; a thread that shares its core with a busy
process waits about half of the time. When the run delay per second of wall time passes `max_wait_share`, the team
drops a thread; after `probe_s` it tries one more again, and each probe that finds the host still busy doubles the
wait before the next (up to `max_probe_s`), so a busy host costs a few slow windows a minute and a quiet one gets its
cores back. The kernels give a row the same bits whatever the thread count, so only speed changes.

Waiting is not always losing: under a CPU quota between two core counts (a container's `--cpus 1.5` for 2 threads) the
larger team's threads wait too, yet it computes more than the smaller one. So where the worker says how much work each
step did (tokens computed), a probe is also weighed by speed: a probe window that waited but computed at least
`min_gain` more tokens per second than the window before it (the smaller team) keeps the thread, and the team keeps it
while its windows stay that much faster than the smaller team was (a probe whose window did not wait sets the same
mark: a quota's throttling comes in bursts); a window that falls back below drops it. The mark lasts `max_probe_s`,
then a waiting window drops the thread and the next probe measures again: rates an hour apart (another load, other
batches) are not compared. Without work figures (ticks with none) the wait share alone decides.

A quota's waits are also told apart at their source: while the cgroup that limits this process is throttled (its
cpu.stat's throttled time, cgroup v2 or v1), every thread of the team waits at once, and a barrier waits for no one;
that time times the team's size is taken out of the run delay before it is compared with `max_wait_share`, so a team
within its quota is not shrunk for the quota's pauses (the default team is already no larger than the quota rounded
up: settings.available_cores).
Does not know models, requests or what a step does: the worker ticks it after each step.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from servelab.settings import cgroup_quota

log = logging.getLogger(__name__)


def process_run_delay_s() -> float | None:
    """Seconds this process's threads have spent waiting for a CPU (runnable, not running) since they started; None
    where the kernel does not say (no schedstat)."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    found = False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
                found = True
        except (OSError, ValueError, IndexError):
            continue  # NOTE: a thread that ended between the listing and the read
    return total / 1e9 if found else None


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_throttled_s(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> float | None:
    """Seconds the nearest cgroup with a CPU quota above this process (its own or an ancestor) has been throttled
    since it was made; None where none limits it or the kernel does not say. Resolved at each call: a process may be
    moved to another cgroup (the busy-host bench does)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and (root / "cgroup.controllers").is_file():  # NOTE: v2 (unified)
            base, stat_key, unit = root, "throttled_usec", 1e6
        elif "cpu" in controllers.split(","):
            base, stat_key, unit = root / controllers, "throttled_time", 1e9
        else:
            continue
        group = base / path.lstrip("/")
        for folder in (group, *group.parents):
            if not folder.is_relative_to(base):
                break
            if cgroup_quota(folder) is not None:
                return _stat_value(folder / "cpu.stat", stat_key, unit)
    return None


def _stat_value(path: Path, key: str, unit: float) -> float | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value) / unit
    except (OSError, ValueError):
        pass
    return None


@dataclass(frozen=True)
class TeamChange:
    at_s: float
    threads: int
    wait_share: float  # run delay per second of wall time over the window that decided it


class ThreadGovernor:
    def __init__(self, max_threads: int, *, min_threads: int = 1, window_s: float = 0.5, max_wait_share: float = 0.2,
                 probe_s: float = 5.0, max_probe_s: float = 60.0, min_gain: float = 0.1,
                 read_delay: Callable[[], float | None] = process_run_delay_s, clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 read_throttled: Callable[[], float | None] = cgroup_throttled_s) -> None:
        self.max_threads, self.min_threads = max_threads, max(1, min(min_threads, max_threads))
        self.window_s, self.max_wait_share = window_s, max_wait_share
        self.probe_s, self.max_probe_s, self.min_gain = probe_s, max_probe_s, min_gain
        self._read_delay, self._clock, self._set_threads = read_delay, clock, set_threads
        self._read_throttled = read_throttled
        self._throttled_at: float | None = None  # the cgroup's throttled seconds when the window opened
        self.threads = max_threads
        self.changes: list[TeamChange] = []  # every change, for the worker's figures and the tests
        self._next_probe_s = probe_s
        self._shrunk_at: float | None = None  # when the team last shrank (None: it is whole)
        self._probing = False  # the team just grew back by one: the next window says whether the core is free
        self._window_start: tuple[float, float] | None = None
        self._last_tick_s = 0.0
        self._work = 0.0  # tokens computed in the open window
        self._last_rate: float | None = None  # the last closed window's tokens per second (None: no work figures)
        self._smaller_rate: float | None = None  # since the team last grew: what the smaller team computed (tokens/s)
        self._smaller_rate_at = 0.0  # when it was measured

    @property
    def is_active(self) -> bool:
        return self.max_threads > self.min_threads and self._read_delay() is not None

    def restart(self) -> None:
        """The next tick opens a fresh window (what ran in between, another team's work say, is not this team's)."""
        self._window_start = None

    def tick(self, work: float = 0.0) -> int:
        """After a step that decoded `work` tokens (0: not said): close the window when it is long enough and resize
        the team if it says so; -> threads.
        NOTE: a tick long after the last (an idle worker) opens a fresh window: an idle stretch would dilute it."""
        now = self._clock()
        if self._window_start is None or now - self._last_tick_s > max(1.0, 4 * self.window_s):
            self._last_tick_s = now
            self._begin(now)
            return self.threads
        self._last_tick_s = now
        self._work += work
        started_s, delay_s = self._window_start
        if now - started_s < self.window_s:
            return self.threads
        delay = self._read_delay()
        if delay is None:
            return self.threads
        share = max(0.0, (delay - delay_s) - self.threads * self._throttled_since()) / (now - started_s)
        rate = self._work / (now - started_s) if self._work > 0 else None
        before, self._last_rate = self._last_rate, rate
        if share > self.max_wait_share and self.threads > self.min_threads:
            if self._probing and _faster(rate, before, self.min_gain):
                # NOTE: its threads waited, yet the larger team computed more (a quota between two core counts): keep
                self._probing, self._smaller_rate, self._smaller_rate_at = False, before, now
                self._shrunk_at = None if self.threads == self.max_threads else now
                self._next_probe_s = self.probe_s
                self._log("kept", share, rate, before)
            elif not self._probing and now - self._smaller_rate_at < self.max_probe_s and \
                    _faster(rate, self._smaller_rate, self.min_gain):
                pass  # NOTE: still faster than the smaller team was, waits and all
            else:
                if self._probing:  # NOTE: the probe found the host still busy: wait longer before the next
                    self._next_probe_s = min(2 * self._next_probe_s, self.max_probe_s)
                self._resize(self.threads - 1, now, share)
                self._probing, self._shrunk_at, self._smaller_rate = False, now, None
        elif self._probing:  # NOTE: the probe's window was quiet: the core is free again
            self._probing, self._smaller_rate, self._smaller_rate_at = False, before, now
            self._shrunk_at = None if self.threads == self.max_threads else now
            self._next_probe_s = self.probe_s
        elif self._shrunk_at is not None and now - self._shrunk_at >= self._next_probe_s:
            self._resize(self.threads + 1, now, share)
            self._probing = True
        self._window_start, self._work = (now, delay), 0.0  # NOTE: the next window opens where this one closed
        return self.threads

    def _throttled_since(self) -> float:
        """Seconds the quota held the whole team since the window opened (0 where no quota limits it); opens the
        next window's count."""
        before, self._throttled_at = self._throttled_at, self._read_throttled()
        return 0.0 if before is None or self._throttled_at is None else max(0.0, self._throttled_at - before)

    def _begin(self, now: float) -> None:
        """A fresh window after an idle stretch or a restart: the rates measured before it are another load's (other
        rows, other batches) and are not compared with the windows after it."""
        delay = self._read_delay()
        self._window_start, self._work = (None if delay is None else (now, delay)), 0.0
        self._throttled_at = self._read_throttled()
        self._last_rate = self._smaller_rate = None

    def _resize(self, threads: int, now: float, share: float) -> None:
        self._set_threads(threads)
        self.threads = threads
        self.changes.append(TeamChange(now, threads, share))
        log.info("thread team: %d thread(s) (its threads waited %.0f%% of the time for a CPU)", threads, 100 * share)

    def _log(self, what: str, share: float, rate: float | None, before: float | None) -> None:
        log.info("thread team: %s %d thread(s): its threads waited %.0f%% of the time, but it computed %.0f tokens/s "
                 "against the smaller team's %.0f", what, self.threads, 100 * share, rate or 0, before or 0)


def _faster(rate: float | None, than: float | None, min_gain: float) -> bool:
    """Whether a window computed at least min_gain more tokens per second than another (False where either is
    unknown: the wait share alone decides then)."""
    return rate is not None and than is not None and rate >= than * (1 + min_gain)

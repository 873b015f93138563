"""servelab's thread team on a busy host, side by side in one process, rounds interleaved: decode tok/s of one config
at 1 thread, at N threads (a fixed team), and at N threads that shrink while other processes take their cores
(servelab/engine/threads.py, what a worker whose config leaves num_threads unset runs), on

- a quiet host;
- a busy one: a process spinning a Python loop, pinned to the last of this process's cores;
- a CPU quota below the thread count: this process moved into a cgroup of its own whose quota is --quota CPUs
  (cgroup v2 cpu.max or v1 cpu.cfs_quota_us; the condition is skipped, saying why, where no cgroup is writable).

Each cell is one closed batch of B rows x --new-tokens tokens (a short prompt, EOS ignored) stepped through the engine
as a worker steps it, the adaptive team ticked after each step; tok/s = generated tokens over the batch's wall time.
Medians over the rounds, and each cell's ratio to 1 thread on the same host in the same round. The adaptive team keeps
its state (how far it shrank, when it probes next) from one batch to the next within a host condition, as a worker's
does, on a clock of its own that runs only while its batches run (a worker's runs while it serves); its mean team
size and every change it made are printed. Greedy tokens are compared across the teams (the kernels give a row the
same bits whatever the thread count).

    python -m bench.busy_host --config configs/fp32.yaml --batch-sizes 1,16 --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.side_by_side import positive_ints
from servelab.config import ServingConfig
from servelab.engine.engine import Engine
from servelab.engine.threads import ThreadGovernor
from servelab.hardware import describe_hardware
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The history of the city of Lyon begins"


def spin(core: int, go, stop, ready) -> None:
    """A busy process: a Python loop on one core while `go` is set."""
    os.sched_setaffinity(0, {core})
    ready.set()
    while not stop.is_set():
        if go.is_set():
            for _ in range(100_000):
                pass
        else:
            go.wait(0.05)


class Quota:
    """This process in a cgroup of its own with a CPU quota (v2 cpu.max, else v1's cfs quota): `on()` / `off()`."""

    def __init__(self, cpus: float) -> None:
        self.cpus, self.reason = cpus, None
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
        name = f"servelab-bench-{os.getpid()}"
        try:
            if (v2 / "cgroup.controllers").is_file() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
                self.group, self.home = v2 / name, v2
                self.group.mkdir()
                (self.group / "cpu.max").write_text(f"{int(cpus * 100_000)} 100000")
            elif (v1 / "cpu.cfs_quota_us").is_file():
                self.group, self.home = v1 / name, v1
                self.group.mkdir()
                (self.group / "cpu.cfs_period_us").write_text("100000")
                (self.group / "cpu.cfs_quota_us").write_text(str(int(cpus * 100_000)))
            else:
                self.group, self.reason = None, "no cgroup cpu controller here"
        except OSError as exc:
            self.group, self.reason = None, f"cannot make a cgroup with a quota ({exc.strerror})"

    def on(self) -> None:
        (self.group / "cgroup.procs").write_text(str(os.getpid()))

    def off(self) -> None:
        (self.home / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        if self.group is not None:
            self.off()
            self.group.rmdir()


@contextmanager
def host(condition: str, go, quota: Quota):
    if condition == "busy":
        go.set()
        time.sleep(0.1)
    elif condition == "quota":
        quota.on()
    try:
        yield
    finally:
        go.clear()
        if condition == "quota":
            quota.off()


class TeamClock:
    """The adaptive team's own time: it runs only while that team's batches run, as a worker's clock runs while it
    serves (the other teams' batches between would otherwise count as its time, and every batch would probe)."""

    def __init__(self) -> None:
        self.elapsed, self.since = 0.0, None

    def start(self) -> None:
        self.since = time.monotonic()

    def stop(self) -> None:
        self.elapsed, self.since = self(), None

    def __call__(self) -> float:
        return self.elapsed + (time.monotonic() - self.since if self.since is not None else 0.0)


def batch(engine: Engine, threads: int, rows: int, new_tokens: int, governor: ThreadGovernor | None
          ) -> tuple[float, list[tuple[int, ...]], float]:
    """One closed batch stepped as a worker steps it -> (tok/s, each row's tokens, the team's mean size per step)."""
    torch.set_num_threads(threads if governor is None else governor.threads)
    if governor is not None:
        governor.restart()  # NOTE: the other teams' batches ran since its last tick
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    done, sizes = {}, []
    started = time.perf_counter()
    out = engine.add([GenerationRequest(f"r{i}", prompt=PROMPT, params=params) for i in range(rows)])
    done.update((c.request_id, c) for c in out.finished)
    while engine.num_live:
        live = engine.num_live  # NOTE: the tokens this step computes (one a row), which weigh a probe's speed
        done.update((c.request_id, c) for c in engine.step().finished)
        sizes.append(torch.get_num_threads() if governor is None else governor.tick(live))
    seconds = time.perf_counter() - started
    engine.take_stats()
    tokens = [tuple(done[f"r{i}"].token_ids) for i in range(rows)]
    return rows * new_tokens / seconds, tokens, statistics.mean(sizes or [threads])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/fp32.yaml")
    parser.add_argument("--threads", type=int, default=min(len(os.sched_getaffinity(0)), 2),
                        help="the team's size (default: 2, or 1 where this process has one core)")
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quota", type=float, default=None, help="CPUs of the quota condition (default: threads - 0.5)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.threads < 2 or len(cores) < args.threads:
        parser.error(f"--threads {args.threads}: needs 2 or more, and as many cores (this process has {len(cores)})")
    if args.new_tokens < 2 or args.rounds < 1:
        parser.error("--new-tokens at least 2, --rounds at least 1")
    n = args.threads
    quota = Quota(args.quota or n - 0.5)
    config = ServingConfig.from_yaml(args.config)
    config = config.model_copy(update={"num_threads": n, "batching": config.batching.model_copy(update={
        "max_batch_size": max(config.batching.max_batch_size, max(args.batch_sizes))})})
    engine = Engine.from_config(config, Settings(cache_dir=REPO / ".cache"))
    context = multiprocessing.get_context("spawn")
    go, stop, ready = context.Event(), context.Event(), context.Event()
    busy = context.Process(target=spin, args=(cores[n - 1], go, stop, ready), daemon=True)
    busy.start()
    assert ready.wait(60), "the busy process did not start"
    conditions = ["quiet", "busy"] + (["quota"] if quota.reason is None else [])
    teams = ["1 thread", f"{n} threads", f"{n} adaptive"]
    print(f"cpu: {describe_hardware().cpu}; config {config.name} ({config.weights}, {engine.kernel}); team of {n} on "
          f"cores {cores[:n]}; busy: a Python loop on core {cores[n - 1]}; quota: "
          + (f"{quota.cpus:g} CPUs" if quota.reason is None else f"skipped, {quota.reason}")
          + f"; {args.rounds} rounds interleaved, medians", flush=True)
    os.sched_setaffinity(0, set(cores[:n]))
    try:
        for condition in conditions:  # NOTE: warm-up (each host condition once), with a team of its own
            with host(condition, go, quota):
                batch(engine, n, 2, 8, ThreadGovernor(n))
        clocks = {c: TeamClock() for c in conditions}
        governors = {c: ThreadGovernor(n, clock=clocks[c]) for c in conditions}
        speed = {(c, t, b): [] for c in conditions for t in teams for b in args.batch_sizes}
        mean_team = {(c, b): [] for c in conditions for b in args.batch_sizes}
        tokens_differ = set()
        for _ in range(args.rounds):
            for condition in conditions:
                with host(condition, go, quota):
                    for b in args.batch_sizes:
                        reference = None
                        for team in teams:
                            governor = governors[condition] if team.endswith("adaptive") else None
                            if governor is not None:
                                clocks[condition].start()
                            tok_s, tokens, size = batch(engine, 1 if team == "1 thread" else n, b, args.new_tokens,
                                                        governor)
                            if governor is not None:
                                clocks[condition].stop()
                            speed[(condition, team, b)].append(tok_s)
                            if governor is not None:
                                mean_team[(condition, b)].append(size)
                            reference = reference or tokens
                            if tokens != reference:
                                tokens_differ.add(team)
        for condition in conditions:
            for b in args.batch_sizes:
                ones = speed[(condition, teams[0], b)]
                cells = []
                for team in teams:
                    samples = speed[(condition, team, b)]
                    ratio = statistics.median(s / o for s, o in zip(samples, ones))
                    cells.append(f"{team} {statistics.median(samples):7.1f} (x{ratio:.2f})")
                print(f"  {condition:<6} batch {b:>3}, tok/s: " + " | ".join(cells)
                      + f"; adaptive team's mean size {statistics.mean(mean_team[(condition, b)]):.2f}", flush=True)
        for condition, governor in governors.items():
            print(f"  {condition}: the adaptive team's changes (threads, its threads' wait per second of wall time): "
                  + (", ".join(f"{c.threads} ({c.wait_share:.2f})" for c in governor.changes) or "none"), flush=True)
        print("  greedy tokens the same for every team: "
              + ("yes" if not tokens_differ else f"no ({', '.join(sorted(tokens_differ))} differ)"), flush=True)
    finally:
        stop.set()
        go.set()
        busy.join(timeout=10)
        quota.remove()


if __name__ == "__main__":
    main()

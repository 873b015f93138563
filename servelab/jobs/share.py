"""Fair share of each config's bulk queue between batch jobs, weighted per tenant: deficit round robin.

Knows the jobs that still have lines to read (tenant, the configs their lines named, a cap on this round),
the tenants' weights, the free room of each config's bulk queue and the round robin's state from the last
round; says how many lines each job may read now, and the next state. Pure: no Redis, SQL or clock (the
feed, servelab/jobs/feed.py, reads those and runs the ingest steps), so a round is tested on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from math import floor

DEFAULT_WEIGHT = 1.0


@dataclass(frozen=True)
class BulkJob:
    """A job with lines left to read, as the share sees it."""

    job_id: str
    tenant: str
    config_names: frozenset[str]  # configs its lines named so far; empty: none yet (see share_round: a probe)
    max_lines: int  # the most it may read this round whatever its share (a slice, its in-flight limit)


@dataclass(frozen=True)
class ShareState:
    """What one round leaves the next: lines each job is still owed, and whom the next round visits first."""

    deficits: Mapping[str, Fraction] = field(default_factory=dict)
    next_job_id: str | None = None


@dataclass(frozen=True)
class ShareRound:
    visits: tuple[tuple[str, int], ...]  # (job, lines given) in the order given: the order lines join a queue
    state: ShareState

    @property
    def rooms(self) -> dict[str, int]:
        """Job -> lines it may read now, in the order first visited; jobs given none left out."""
        rooms: dict[str, int] = {}
        for job_id, n in self.visits:
            rooms[job_id] = rooms.get(job_id, 0) + n
        return rooms


def quanta(jobs: Sequence[BulkJob], weights: Mapping[str, float]) -> dict[str, Fraction]:
    """Lines per visit: the tenant's weight split evenly among its jobs, scaled so the smallest quantum is one
    line (every visit to a job with room gives it a line at least, so a round always ends)."""
    num_jobs: dict[str, int] = {}
    for job in jobs:
        num_jobs[job.tenant] = num_jobs.get(job.tenant, 0) + 1
    raw = {job.job_id: Fraction(weights.get(job.tenant, DEFAULT_WEIGHT)) / num_jobs[job.tenant] for job in jobs}
    assert all(q > 0 for q in raw.values()), f"tenant weights must be positive, got {dict(weights)}"
    smallest = min(raw.values(), default=Fraction(1))
    return {job_id: q / smallest for job_id, q in raw.items()}


def share_round(jobs: Sequence[BulkJob], *, weights: Mapping[str, float], free: Mapping[str, int],
                state: ShareState) -> ShareRound:
    """How many lines each job may read now, so that what enters each config's bulk queue is shared fairly.

    Deficit round robin (Shreedhar and Varghese), one line a packet. `free` is each bounded config's room:
    its bound on queued-but-not-started bulk lines less those queued now; a config not named is unbounded.
    A job's lines may go to any config it named, so a line given to it takes room in each of them. A job
    that named none yet takes room in each bounded config that has room left (its slice is a probe: one
    full config, a slow worker at its bound, must not hold back every new job); its names are known after
    that slice, so it may overfill a full config once, by the others' room at most. Jobs are visited in pass after pass, from state.next_job_id on
    (jobs that ended are dropped). A visit to a job with room adds its quantum (its tenant's weight over
    the tenant's jobs here: a tenant's share is split among its jobs) to its deficit and gives it the whole
    lines of the deficit that fit; a job without room is passed over and banks nothing, so credit never
    piles up while a queue is full. The round ends when no job has room. A deficit is capped at its
    quantum, so a job cut short by a full queue is owed one visit's lines at most; the next round starts
    after the last job given lines. Over rounds each job's lines are its quantum's share of what its
    configs freed, to within one quantum: a newcomer's lines wait behind one bound's worth, not a backlog.
    The visits say in which order the lines join the queues (the feed interleaves the jobs' slices so),
    so a job given more than it has left (its file ends) never puts another job's lines ahead of its own.
    """
    jobs = [job for job in jobs if job.max_lines > 0]
    if not jobs:
        return ShareRound((), ShareState())
    quantum = quanta(jobs, weights)
    ids = [job.job_id for job in jobs]
    start = ids.index(state.next_job_id) if state.next_job_id in ids else 0
    order = jobs[start:] + jobs[:start]
    deficits = {job.job_id: Fraction(state.deficits.get(job.job_id, 0)) for job in jobs}
    rooms = {job.job_id: 0 for job in order}
    visits: list[tuple[str, int]] = []
    free = dict(free)
    last_given: str | None = None

    def taking(job: BulkJob) -> list[str]:
        """The bounded configs a line of this job takes room in."""
        if job.config_names:
            return sorted(job.config_names & free.keys())
        return sorted(name for name, n in free.items() if n > 0)

    def room(job: BulkJob) -> int:
        if not job.config_names and free and not any(n > 0 for n in free.values()):
            return 0  # NOTE: a probe waits while every bounded config is full; with none bounded it is free
        return min([free[name] for name in taking(job)] + [job.max_lines - rooms[job.job_id]])

    while any(room(job) > 0 for job in order):
        for job in order:
            can = room(job)
            if can <= 0:
                continue
            if taking(job):
                deficits[job.job_id] += quantum[job.job_id]
                given = min(floor(deficits[job.job_id]), can)
                deficits[job.job_id] = min(deficits[job.job_id] - given, quantum[job.job_id])
            else:
                given = can  # NOTE: its lines name only unbounded configs: nothing to share
            rooms[job.job_id] += given
            if given:
                visits.append((job.job_id, given))
            for name in taking(job):
                free[name] -= given
            last_given = job.job_id if given else last_given
    next_job_id = ids[(ids.index(last_given) + 1) % len(ids)] if last_given is not None else state.next_job_id
    return ShareRound(tuple(visits), ShareState({job_id: d for job_id, d in deficits.items() if d}, next_job_id))

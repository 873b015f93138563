"""How `servelab up` splits this host's cores: a core kept for the stack's own processes where the gpu-workers leave one
spare, the rest in contiguous shares, one per gpu-worker, so two workers never run on one core unless asked.

Pure: takes the free cores and the names; does not start or pin anything (servelab/stack.py does).
"""

from __future__ import annotations


class CoreSplitError(ValueError):
    """The cores cannot be split as asked; the message says why and what to change."""


def split_cores(workers: list[str], others: list[str], free: list[int], stack_cores: int | None
                ) -> dict[str, tuple[int, ...]]:
    """The free cores for the gpu-workers to start and the stack's other processes: `stack_cores` of them (default 1)
    kept for the others (api, jobs-worker, beat), pinned there, where the workers leave that many spare; the rest
    split between the workers (worker_cores). No worker to start: nothing is pinned.

    NOTE: on a 2-core host the served worker alone on one core served more than a team of 2 threads on both (AIPerf,
    concurrency 8: 105-116 against 62-65 output tok/s, docs/performance.md "Threads on a busy host"): the api, the
    relays, Redis, PostgreSQL and the client need a core of their own, and a team that shares one waits at every
    barrier. The embedded Redis and PostgreSQL, started earlier, are not pinned; the kernel's balancer runs them
    where the pinned workers leave room."""
    if not workers:
        return {}
    spare = max(len(free) - len(workers), 0)
    if stack_cores is not None and stack_cores > spare:
        raise CoreSplitError(f"SERVELAB_STACK_CORES is {stack_cores}, but {len(free)} free core(s) "
                         f"({format_cores(free) or 'none'}) and {len(workers)} gpu-worker(s) to start leave {spare} "
                         f"spare: set it to at most {spare} (0: the workers take every core)")
    keep = min(1, spare) if stack_cores is None else stack_cores
    split = worker_cores(workers, free[keep:])
    return {**split, **({name: tuple(free[:keep]) for name in others} if keep else {})}


def worker_cores(names: list[str], free: list[int]) -> dict[str, tuple[int, ...]]:
    """The free cores split between the gpu-workers `names` in contiguous shares, as even as they go (the first
    shares one core more); a worker's torch threads default to its share (servelab.settings.available_cores).
    Fewer free cores than workers: StackError, since two would share a core."""
    if not names:
        return {}
    if len(free) < len(names):
        raise CoreSplitError(f"{len(names)} gpu-worker(s) to start ({', '.join(names)}) and {len(free)} free core(s) "
                         f"({format_cores(free) or 'none'}): each needs a core of its own; stop one, or pass "
                         "--share-cores to let the workers share every core")
    share, extra = divmod(len(free), len(names))
    out, at = {}, 0
    for i, name in enumerate(names):
        size = share + (i < extra)
        out[name] = tuple(free[at:at + size])
        at += size
    return out


def format_cores(cores) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)

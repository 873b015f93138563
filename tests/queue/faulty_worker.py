"""Test-only: the real gpu-worker process, with an engine that crashes or stalls on marked prompts.

A prompt containing CRASH kills the process (os._exit) at any step it is in; one containing DIE kills it once,
when it has made three tokens (the file `died` beside the stall marker remembers it), mid-stream; SLOW makes
each step it is in take 50 ms longer (so others can join it mid-way); one containing STALL
hangs the first time it has made two tokens (it leaves the file named by SERVELAB_TEST_STALL_MARKER,
holding the request ids in the batch and their token counts), so the test can kill -9 the worker in the
middle of a step, with rows at different stages.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from servelab.engine.dense_runner import TransformersRunner
from servelab.engine.runner import PagedRunner


def faulty(real_execute):
    """A runner's execute that crashes or stalls on the marked prompts of the plan's rows first."""

    def execute(self, plan):
        _fault(list(plan.rows))
        return real_execute(self, plan)

    return execute


def _fault(rows) -> None:
    prompts = {r.request.request_id: r.request.prompt or "" for r in rows}
    if any("CRASH" in p for p in prompts.values()):
        os._exit(17)
    if any("SLOW" in p for p in prompts.values()):
        time.sleep(0.05)
    marker = Path(os.environ["SERVELAB_TEST_STALL_MARKER"])
    died = marker.with_name("died")
    if any("DIE" in (r.request.prompt or "") and r.num_generated_tokens >= 3 for r in rows) and not died.exists():
        died.write_text("1")
        os._exit(17)
    stalling = [r for r in rows if "STALL" in (r.request.prompt or "") and r.num_generated_tokens >= 2]
    if stalling and not marker.exists():
        marker.write_text(json.dumps({r.request.request_id: r.num_generated_tokens for r in rows}))
        time.sleep(3600)


PagedRunner.execute = faulty(PagedRunner.execute)
TransformersRunner.execute = faulty(TransformersRunner.execute)

if __name__ == "__main__":
    from worker.gpu import main

    sys.exit(main(sys.argv[1:]))

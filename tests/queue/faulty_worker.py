"""Test-only: the real gpu-worker process, with an engine that crashes or stalls on marked prompts.

A prompt containing CRASH kills the process (os._exit) whenever it is served; one containing STALL
hangs the first time it is served (it leaves the file named by SERVELAB_TEST_STALL_MARKER), so the
test can kill -9 the worker in the middle of that batch.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from servelab.engine.engine import Engine

_real_generate = Engine.generate


def _faulty_generate(self, requests):
    prompts = [r.prompt or "" for r in requests]
    if any("CRASH" in p for p in prompts):
        os._exit(17)
    marker = Path(os.environ["SERVELAB_TEST_STALL_MARKER"])
    if any("STALL" in p for p in prompts) and not marker.exists():
        marker.write_text(str(len(requests)))
        time.sleep(3600)
    return _real_generate(self, requests)


Engine.generate = _faulty_generate

if __name__ == "__main__":
    from worker.gpu import main

    sys.exit(main(sys.argv[1:]))

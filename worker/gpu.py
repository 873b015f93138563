"""The gpu-worker process: one serving config on one device, fed by its Redis streams.

Thin: reads Settings once, connects, and hands over to servelab.serving.run_worker.
Usage: python -m worker.gpu configs/fp32.yaml   (or `servelab worker --config configs/fp32.yaml`)
"""

from __future__ import annotations

import logging
import sys

from servelab.config import ConfigError, ServingConfig
from servelab.runtime import connect
from servelab.serving import run_worker
from servelab.settings import Settings


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if len(argv) != 1:
        print("usage: python -m worker.gpu CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        config = ServingConfig.from_yaml(argv[0])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runtime = connect(Settings())
    try:
        run_worker(config, runtime)
    finally:
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

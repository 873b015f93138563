"""Entry point: `python -m bench.peers --help`."""

from bench.peers.run import main

raise SystemExit(main())

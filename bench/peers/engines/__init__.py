"""One adapter per engine, each run as `python -m bench.peers.engines.<name>` under that engine's venv.

Each imports its engine inside its loader only, after bench/peers/protocol.py has set the thread
variables, and answers through protocol.serve.
"""

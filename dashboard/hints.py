"""What to do next, said where a page has nothing to show: the command to run, not just "no data".

Knows the servelab commands that make runs, comparisons and sweeps. Does not run them: the dashboard only reads.
"""

from __future__ import annotations

import streamlit as st
from sqlalchemy.exc import SQLAlchemyError

COMPARE = "servelab compare plans/precision.yaml"
RUN = "servelab run -c configs/bf16.yaml -w workloads/smoke.yaml"
SWEEP = "servelab sweep --configs configs/fp32.yaml,configs/awq-int4.yaml --batch-sizes 1,2,4,8,16,32"
MIGRATE = "alembic upgrade head"


def no_runs() -> None:
    st.info("No runs yet. A comparison plan serves a baseline and its candidates on one workload, "
            "through the real queue, and stores every run and the verdict:")
    st.code(COMPARE, language="bash")
    st.caption("Or serve one config on one workload: " + f"`{RUN}`")


def one_run(config_name: str, workload_name: str) -> None:
    st.info(f"Only one run so far ({config_name} on {workload_name}). A comparison needs a baseline and a "
            "candidate on the same workload: serve another config on it, or run a plan.")
    st.code(f"servelab run -c configs/bf16.yaml -w workloads/{workload_name}.yaml\n{COMPARE}", language="bash")


def database_unreadable(error: Exception) -> None:
    st.error(f"The database cannot be read: {type(error).__name__}: {str(error).splitlines()[0]}")
    st.caption("A new database has no tables until it is migrated (any servelab command that serves does it):")
    st.code(MIGRATE, language="bash")


def runs_or_explain(read_runs):
    """The run listing, or None after saying why there is none (database unreadable, no runs yet)."""
    try:
        listing = read_runs()
    except SQLAlchemyError as exc:
        database_unreadable(exc)
        return None
    if not listing:
        no_runs()
        return None
    return listing
